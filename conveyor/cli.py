"""The ``conveyor`` command line: ``list``, ``check_env``, ``chat`` (in-process), ``serve api_server``,
``serve api_client``, ``serve gradio`` (web chat), ``lite``.

LMDeploy's commands run after changing the program name: every ``--long-option`` is accepted in
both spellings (``--server-port`` / ``--server_port``, as LMDeploy's docs use both), ``--backend
turbomind|pytorch`` is accepted (conveyor has one engine, which both names select), and ``chat``
takes the engine flags ``serve api_server`` takes.
"""

from __future__ import annotations

import argparse
import copy as _copy
import sys
from collections.abc import Sequence

from conveyor.engine.config import KERNEL_MODES, TP_ALL_REDUCE_KINDS, EngineConfig, parse_cache_size
from conveyor.lite import add_lite_parser
from conveyor.protocol.sampling import INTERACTIVE_DEFAULTS
from conveyor.services.tokenizer.chat_template import list_chat_templates


def _cmd_list(args: argparse.Namespace) -> int:
    """Print the built-in chat template names, then the model families (architectures) the engine runs."""
    from conveyor.engine.models import SUPPORTED_ARCHITECTURES

    print("chat templates:")
    for name in list_chat_templates():
        print(f"  {name}")
    print("model families (config.json architectures):")
    for name in sorted(SUPPORTED_ARCHITECTURES):
        print(f"  {name}")
    return 0


def _cmd_check_env(args: argparse.Namespace) -> int:
    """Print what conveyor runs on: Python, platform, the packages it needs, the GPUs and NCCL."""
    import importlib.metadata as md
    import platform

    def version(pkg: str) -> str:
        try:
            return md.version(pkg)
        except md.PackageNotFoundError:
            return "not installed"

    rows = [("python", sys.version.split()[0]), ("platform", platform.platform()),
            ("conveyor", version("conveyor"))]
    rows += [(pkg, version(pkg)) for pkg in ("torch", "triton", "transformers", "safetensors", "pyzmq", "msgspec",
                                              "fastapi", "uvicorn", "uvloop", "cupy-cuda12x", "gguf")]
    import torch

    cuda = torch.cuda.is_available()
    rows.append(("CUDA", f"{torch.version.cuda} ({torch.cuda.device_count()} GPU(s))" if cuda else "not available"))
    for i in range(torch.cuda.device_count() if cuda else 0):
        props = torch.cuda.get_device_properties(i)
        rows.append((f"GPU {i}", f"{props.name}, {props.total_memory / 2**30:.0f} GiB, sm_{props.major}{props.minor}"))
    nccl = torch.cuda.nccl.version() if cuda and torch.distributed.is_nccl_available() else None
    rows.append(("NCCL", ".".join(map(str, nccl)) if nccl else "not available (tensor parallel runs gloo on the CPU)"))
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    return 0


def _cmd_chat(args: argparse.Namespace) -> int:
    """Multi-turn chat in the terminal; the session's history stays in the engine's KV cache."""
    from conveyor import GenerationConfig, pipeline
    from conveyor.default_model import local_path
    from conveyor.services.tokenizer.chat_template import template_config

    from conveyor.errors import ConveyorError

    model = local_path(args.model, _say)
    interactive = sys.stdin.isatty()
    try:  # pipeline() checks --model-name, the model and tp (engine/preflight.py) before it loads anything
        gen = GenerationConfig(max_new_tokens=args.max_new_tokens, top_k=args.top_k, top_p=args.top_p,
                               temperature=args.temperature, adapter_name=chat_adapter(args))
        config = _engine_config(args)
        config.enable_prefix_caching = True  # a session's turns reuse its cached history
        pipe = pipeline(model, config, chat_template_config=template_config(args.chat_template),
                        model_name=args.model_name)
    except ConveyorError as exc:
        print(f"conveyor: {exc}", file=sys.stderr)
        return 2
    with pipe:
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
            try:
                for chunk in stream:
                    print(chunk.text, end="", flush=True)
                print()
            except KeyboardInterrupt:  # Ctrl-C stops this answer (aborted in the engine); 'exit' quits
                stream.close()
                print(" [stopped]")
    return 0


def chat_adapter(args: argparse.Namespace) -> str | None:
    """The LoRA adapter ``chat`` talks through: --adapter-name, else the first of --adapters (as
    LMDeploy's chat does), else None (the base model)."""
    from conveyor.errors import EngineConfigError

    adapters = args.adapters or {}
    if args.adapter_name is None:
        return next(iter(adapters), None)
    if args.adapter_name not in adapters:
        given = ", ".join(adapters) or "none"
        raise EngineConfigError(f"--adapter-name {args.adapter_name}: not one of --adapters ({given}); give "
                                "--adapters NAME=PATH for it")
    return args.adapter_name


def _say(line: str) -> None:
    """A progress line on stderr (fetching the default model takes a minute the first time)."""
    print(f"conveyor: {line}", file=sys.stderr, flush=True)


def _read_prompt(interactive: bool) -> str | None:
    """One prompt: up to a blank line when typing, one line per prompt when piped."""
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


def _port_refusal(host: str, port: int) -> str | None:
    """The message saying why ``host:port`` cannot be served on (in use, no such address, ...),
    or None. Checked before any model loads: the ingress binds last, a minute after the model
    has loaded."""
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, _, _, _, addr = infos[0]
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
            sock.bind(addr)
    except OSError as exc:
        return (f"conveyor: cannot serve on {host}:{port}: {exc.strerror or exc}. Stop what uses it "
                "or pick another port with --server-port")
    return None


def _cmd_api_server(args: argparse.Namespace) -> int:
    """Start every stage as a process and serve the OpenAI-compatible API until SIGTERM."""
    refusal = _port_refusal(args.server_name, args.server_port)
    if refusal:
        print(refusal, file=sys.stderr)
        return 1
    from conveyor.errors import ConveyorError
    from conveyor.services.tokenizer.chat_template import template_config

    try:  # a bad template, QoS file, model or tp is reported now, not by a stage that keeps restarting
        template_config(args.chat_template)
        _check_parsers(args)
        _image_limits(args)  # a bad limit is reported now, not by each tokenizer worker
        qos = _qos_config(args)
        engine = _engine_config(args)
        model, served_name = _served_model(args)
        _preflight(model, engine, reads_weights=not args.engine_factory)
    except ConveyorError as exc:
        print(f"conveyor: {exc}", file=sys.stderr)
        return 2
    from conveyor.services.launcher import ServerArgs, serve

    return serve(ServerArgs(
        model_path=model, server_name=args.server_name, server_port=args.server_port,
        tokenizer_workers=args.tokenizer_workers, api_keys=_api_keys(args), chat_template=args.chat_template,
        served_model_name=served_name, engine=engine, log_level=args.log_level, engine_factory=args.engine_factory,
        drain_timeout=args.drain_timeout, max_restarts=args.max_restarts, limits=_limits(args), qos=qos,
        proxy_url=args.proxy_url, proxy_admin_key=_proxy_admin_key(args), tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser, image_limits=_image_limits(args)))


def _check_parsers(args: argparse.Namespace) -> None:
    """--tool-call-parser / --reasoning-parser name known parsers (the error lists them)."""
    from conveyor.services.ingress.reasoning_parsers import check_reasoning_parser
    from conveyor.services.ingress.tool_parsers import check_tool_parser

    if args.tool_call_parser:
        check_tool_parser(args.tool_call_parser)
    if args.reasoning_parser:
        check_reasoning_parser(args.reasoning_parser)


def _preflight(model: str, engine: EngineConfig, reads_weights: bool) -> None:
    """The model's path, config, weights' headers and tp split, checked before any stage starts
    (engine/preflight.py). Without ``reads_weights`` (a stage other than the engine, an engine
    factory's engine: conveyor.testing.serve) only the path and config.json."""
    from conveyor.engine.preflight import preflight

    preflight(model, engine, weights=reads_weights)


def _served_model(args: argparse.Namespace) -> tuple[str, str | None]:
    """(the model path every stage reads, the name /v1/models reports). With --dummy-weights SHAPE:
    a directory of SHAPE's config.json and the tokenizer of MODEL (default: the default model)."""
    from conveyor.default_model import local_path

    model = local_path(args.model, _say)
    if not args.dummy_weights:
        return model, args.model_name
    from conveyor.engine.dummy_model import served_model_dir, shape_name
    from conveyor.engine.preflight import locate_model

    return str(served_model_dir(args.dummy_weights, locate_model(model))), \
        args.model_name or shape_name(args.dummy_weights)


def _limits(args: argparse.Namespace):
    """The ingress's limits from the command line (0 for --request-timeout: none)."""
    from conveyor.services.ingress.limits import IngressLimits

    return IngressLimits(max_prompt_chars=args.max_prompt_chars, max_prompts=args.max_prompts,
                         max_sequences=args.max_sequences_per_request, max_queued=args.max_queued_requests,
                         request_timeout_s=args.request_timeout or None, header_timeout_s=args.header_timeout,
                         body_timeout_s=args.body_timeout, max_connections=args.max_connections,
                         max_body_bytes=args.max_body_bytes)


def _image_limits(args: argparse.Namespace):
    """What a request's images may be, from the command line (a flag left out: the default)."""
    from conveyor.services.tokenizer.images import ImageLimits

    given = {"max_images": args.max_images_per_request, "max_pixels": args.max_image_pixels,
             "max_bytes": args.max_image_bytes, "fetch_timeout_s": args.image_fetch_timeout}
    return ImageLimits(allow_remote=not args.disable_image_fetch, allowed_hosts=tuple(args.allowed_media_domains),
                       **{name: value for name, value in given.items() if value is not None})


def _qos_config(args: argparse.Namespace):
    """The QoS user groups of --qos-config-path (None without it); raises QosConfigError naming the problem."""
    from conveyor.services.ingress.qos import QosConfig

    return QosConfig.load(args.qos_config_path) if args.qos_config_path else None


# Keys may come from the environment, which keeps them out of `ps` (conveyor/envs.py says what each holds).
API_KEYS_ENV = "CONVEYOR_API_KEYS"
ADMIN_KEYS_ENV = "CONVEYOR_PROXY_ADMIN_KEYS"  # one variable for the proxy and an api_server joining it


def _keys(listed: list[str] | None, path: str | None, env: str) -> list[str]:
    """Keys given on the command line, then the lines of ``path`` (# comments skipped), then ``$env``."""
    from conveyor import envs

    keys = list(listed or [])
    if path:
        # A key file that cannot be read, or holds no key, must not start a server without keys.
        try:
            with open(path) as f:
                from_file = [line.strip() for line in f if line.strip() and not line.startswith("#")]
        except OSError as exc:
            print(f"conveyor: cannot read the key file {path}: {exc.strerror or exc}", file=sys.stderr)
            raise SystemExit(2) from None
        if not from_file:
            print(f"conveyor: the key file {path} holds no key (one a line; # starts a comment)", file=sys.stderr)
            raise SystemExit(2)
        keys += from_file
    return keys + envs.key_list(env)


def _api_keys(args: argparse.Namespace) -> list[str] | None:
    """The accepted API keys: --api-keys, the lines of --api-keys-file and $CONVEYOR_API_KEYS."""
    return _keys(args.api_keys, args.api_keys_file, API_KEYS_ENV) or None


def _admin_keys(args: argparse.Namespace) -> list[str] | None:
    """The proxy's admin keys: --admin-keys, the lines of --admin-keys-file and $CONVEYOR_PROXY_ADMIN_KEYS."""
    return _keys(args.admin_keys, args.admin_keys_file, ADMIN_KEYS_ENV) or None


def _proxy_admin_key(args: argparse.Namespace) -> str | None:
    """The admin key an api_server joins its --proxy-url with: the first of --proxy-admin-key-file,
    else of $CONVEYOR_PROXY_ADMIN_KEYS (a file or the environment: a flag's value shows in ps)."""
    if args.proxy_admin_key_file and not args.proxy_url:
        print("conveyor: --proxy-admin-key-file is for joining a proxy: give --proxy-url too", file=sys.stderr)
        raise SystemExit(2)
    keys = _keys(None, args.proxy_admin_key_file, ADMIN_KEYS_ENV)
    return keys[0] if keys else None


def _engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(tp=args.tp, session_len=args.session_len, max_batch_size=args.max_batch_size,
                        cache_max_entry_count=args.cache_max_entry_count,
                        quant_policy=args.quant_policy, model_format=args.model_format,
                        enable_prefix_caching=args.enable_prefix_caching, block_size=args.cache_block_seq_len,
                        max_prefill_token_num=args.max_prefill_token_num, dtype=args.dtype, device=args.device,
                        session_idle_timeout=args.session_idle_timeout or None,
                        eager_mode=args.eager_mode, kernels=args.kernels, tp_all_reduce=args.tp_all_reduce,
                        tp_hang_timeout=args.tp_hang_timeout,
                        load_format="dummy" if getattr(args, "dummy_weights", None) else "auto",
                        adapters=args.adapters, max_loras=args.max_loras, max_lora_rank=args.max_lora_rank)


def _cmd_stage(args: argparse.Namespace) -> int:
    """Run one stage in the foreground over tcp:// (a compose service); peers found by service name."""
    from conveyor.engine.weight_loader import load_model_config
    from conveyor.errors import ConveyorError
    from conveyor.protocol import Addresses, CurveKeys, SecurityError

    try:  # first: a stage without keys must not load a model before it says so
        keys = CurveKeys.load(args.curve_key_file) if args.curve_key_file else None
        addresses = Addresses.tcp(base_port=args.base_port, curve=keys)
        qos = _qos_config(args)  # every stage checks it: a compose file passes the same flags to all
        _check_parsers(args)
        model, served_name = _served_model(args)
        _preflight(model, _engine_config(args), reads_weights=args.stage == "engine" and not args.engine_factory)
    except (SecurityError, ConveyorError) as exc:
        print(f"conveyor: {exc}", file=sys.stderr)
        return 2
    session_len = args.session_len or load_model_config(model).max_position_embeddings
    if args.stage == "engine":
        from conveyor.services.engine.process import run_engine_process

        run_engine_process("engine", addresses, model, _engine_config(args), None, args.log_level, args.engine_factory)
    elif args.stage == "tokenizer":
        from conveyor.services.tokenizer.process import run_tokenizer_process

        run_tokenizer_process("tokenizer", addresses, model, session_len, args.chat_template, None, args.log_level,
                              _image_limits(args))
    elif args.stage == "detokenizer":
        from conveyor.services.detokenizer.process import run_detokenizer_process

        run_detokenizer_process("detokenizer", addresses, model, None, args.log_level)
    else:
        from conveyor.services.ingress.process import run_ingress_process

        name = served_name or model.rstrip("/").split("/")[-1]
        run_ingress_process("ingress", addresses, model, name, session_len, args.server_name, args.server_port,
                            _api_keys(args), None, args.log_level, args.drain_timeout, _limits(args), qos,
                            args.proxy_url, _proxy_admin_key(args), chat_template=args.chat_template,
                            tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser,
                            adapter_paths=args.adapters)
    return 0


def _cmd_keygen(args: argparse.Namespace) -> int:
    """Write a deployment's CURVE key pair for the tcp:// stages (mode 0600, never overwritten)."""
    import os

    from conveyor.protocol import CurveKeys

    if os.path.exists(args.path):
        if args.keep_existing:
            CurveKeys.load(args.path)  # still fail loudly on a file that is not a key
            return 0
        print(f"conveyor: {args.path} exists; not overwriting a deployment's key (--keep-existing: keep it)",
              file=sys.stderr)
        return 1
    CurveKeys.generate().save(args.path)
    print(f"wrote {args.path}: give every stage CONVEYOR_CURVE_KEY_FILE={args.path}", file=sys.stderr)
    return 0


def _cmd_proxy(args: argparse.Namespace) -> int:
    """LMDeploy's request distributor: nodes join with api_server --proxy-url or POST /nodes/add."""
    from conveyor.services.proxy import run_proxy

    for flag, seconds in (("--health-interval", args.health_interval), ("--first-byte-timeout",
                          args.first_byte_timeout), ("--chunk-timeout", args.chunk_timeout)):
        if not seconds > 0:
            print(f"conveyor: {flag} must be positive (seconds)", file=sys.stderr)
            return 2
    api_keys, admin_keys = _api_keys(args), _admin_keys(args)
    if set(api_keys or ()) & set(admin_keys or ()):
        print("conveyor: a key is both an API key and an admin key: a client holding it could change the proxy's "
              "routing; give the admin keys values of their own", file=sys.stderr)
        return 2
    return run_proxy(args.server_name, args.server_port, args.strategy, api_keys, args.health_interval,
                     args.log_level, admin_keys=admin_keys, first_byte_timeout_s=args.first_byte_timeout,
                     chunk_timeout_s=args.chunk_timeout)


def _cmd_api_client(args: argparse.Namespace) -> int:
    """Terminal chat against a running server's /v1/chat/interactive."""
    from conveyor.api_client import terminal_chat

    return terminal_chat(args.api_server_url, api_key=args.api_key, session_id=args.session_id,
                         request_output_len=args.request_output_len)


def _cmd_gradio(args: argparse.Namespace) -> int:
    """The web chat: the engine in this process (MODEL), or a running api_server (an http:// URL)."""
    refusal = _port_refusal(args.server_name, args.server_port)
    if refusal:
        print(refusal, file=sys.stderr)
        return 1
    from conveyor.api_client import APIConnectionError, APIError
    from conveyor.errors import ConveyorError

    target = args.model_path_or_server
    try:
        if target and target.startswith(("http://", "https://")):
            backend = _webchat_client(args, target)
        else:
            if args.api_key:
                raise ConveyorError("--api-key is for an api_server URL; a model path runs in this process")
            backend = _webchat_pipeline(args, target)
    except (ConveyorError, APIError, APIConnectionError) as exc:
        print(f"conveyor: {exc}", file=sys.stderr)
        return 2
    from conveyor.webchat import serve_webchat

    host = "localhost" if args.server_name in ("0.0.0.0", "::") else args.server_name
    print(f"web chat with {backend.model_name}: open http://{host}:{args.server_port} in a browser", file=sys.stderr)
    return serve_webchat(backend, args.server_name, args.server_port, args.log_level)


def _webchat_client(args: argparse.Namespace, url: str):
    """URL mode: the server runs the model, so engine flags here would be ignored: refuse them."""
    from conveyor.errors import ConveyorError
    from conveyor.webchat import ApiServerBackend

    probe = argparse.ArgumentParser()
    _engine_options(probe)
    given = [f"--{name.replace('_', '-')}" for name, default in vars(probe.parse_args([])).items()
             if name != "backend" and getattr(args, name) != default]  # --backend: accepted everywhere
    given += [flag for flag, value in (("--chat-template", args.chat_template), ("--model-name", args.model_name))
              if value]
    if given:
        raise ConveyorError(f"{', '.join(given)}: the api_server at {url} runs the model; give these to "
                            "'conveyor serve api_server' instead")
    return ApiServerBackend(url, args.api_key)


def _webchat_pipeline(args: argparse.Namespace, model: str | None):
    """In-process mode: a pipeline on MODEL with the engine flags (prefix caching on, as chat)."""
    from conveyor import pipeline
    from conveyor.default_model import fetch
    from conveyor.services.tokenizer.chat_template import template_config
    from conveyor.webchat import PipelineBackend

    template = template_config(args.chat_template)
    config = _engine_config(args)
    config.enable_prefix_caching = True  # a session's turns reuse its cached history
    return PipelineBackend(pipeline(model or str(fetch()), config, chat_template_config=template,
                                    model_name=args.model_name))


def _engine_options(s: argparse.ArgumentParser, cache_default: float = 0.8) -> None:
    """The engine's flags (``_engine_config``), shared by ``serve api_server``, ``serve stage`` and ``chat``."""
    e = s.add_argument_group("engine")
    e.add_argument("--backend", choices=["turbomind", "pytorch"], default=None,
                   help="accepted for LMDeploy's commands: conveyor has one engine, which both names select")
    e.add_argument("--tp", type=int, default=1, help="tensor parallel: GPUs (processes) the model is split over")
    e.add_argument("--session-len", type=int, default=None,
                   help="tokens of context per session (default: the model's max_position_embeddings)")
    e.add_argument("--max-batch-size", type=int, default=128, help="sequences run together in one step")
    e.add_argument("--cache-max-entry-count", type=parse_cache_size, default=cache_default,
                   help="KV cache: a fraction of the free memory (0.8), a number of blocks (an integer: 2000) "
                        "or a size (4GiB)")
    e.add_argument("--cache-block-seq-len", type=int, default=64, help="tokens per KV cache block")
    e.add_argument("--enable-prefix-caching", action="store_true", help="reuse the KV cache of shared prompt prefixes")
    e.add_argument("--max-prefill-token-num", type=int, default=8192, help="prompt tokens one step may compute")
    e.add_argument("--quant-policy", type=int, default=0, help="KV cache: 0 (16-bit), 8 (int8) or 4 (int4)")
    e.add_argument("--model-format", default=None,
                   help="awq or smooth_quant to insist on that format (default: whatever the checkpoint is)")
    e.add_argument("--dtype", default="auto", help="auto (the checkpoint's), float16, bfloat16 or float32")
    e.add_argument("--device", default="auto", help="auto (cuda when there is a GPU), cuda or cpu")
    e.add_argument("--session-idle-timeout", type=float, default=600.0,
                   help="seconds an interactive session may sit idle before its KV cache is freed "
                        "(its history is kept and recomputed on the next turn; 0: never)")
    # The defaults and choices below are EngineConfig's own (engine/config.py says what each means).
    e.add_argument("--eager-mode", action="store_true", default=EngineConfig.eager_mode,
                   help="run every step eagerly, without the decode CUDA graphs (slower; for debugging)")
    e.add_argument("--kernels", choices=KERNEL_MODES, default=EngineConfig.kernels,
                   help="auto: Triton kernels on the GPU, torch references elsewhere; ref: the torch references "
                        "everywhere; triton: Triton everywhere")
    e.add_argument("--tp-all-reduce", choices=TP_ALL_REDUCE_KINDS, default=EngineConfig.tp_all_reduce,
                   help="tensor parallel: how decode-sized all-reduces are summed (one_shot / two_shot read the "
                        "peer GPUs' memory over NVLink, bfloat16 only; fused sums o_proj / down_proj parts inside "
                        "the residual add + RMSNorm kernel after them)")
    e.add_argument("--tp-hang-timeout", type=float, default=EngineConfig.tp_hang_timeout,
                   help="tensor parallel: seconds a rank may stay silent before it is taken for frozen and "
                        "every rank is stopped")
    lora = s.add_argument_group("LoRA adapters")
    lora.add_argument("--adapters", nargs="+", action=_AdaptersAction, default=None, metavar="NAME=PATH",
                      help="LoRA adapters (PEFT checkpoint directories) loaded at start: name=path pairs, or one "
                           "path, named 'default'; a request runs with one by naming it as its model")
    lora.add_argument("--max-loras", type=_positive_int, default=None, metavar="N",
                      help="adapters the device holds at once (and a step mixes); setting it turns LoRA on, so "
                           "adapters can be loaded at run time (POST /v1/load_lora_adapter) (default: one per "
                           "adapter given, at most 8)")
    lora.add_argument("--max-lora-rank", type=_positive_int, default=None, metavar="R",
                      help="the largest adapter rank the device slots hold (default: the largest given, at least 16)")


def parse_adapters(values: Sequence[str]) -> dict[str, str]:
    """``--adapters`` values as {name: path}: ``name=path`` pairs, or one bare path, which LMDeploy
    names ``default``. ValueError, saying the fix, for anything else."""
    if len(values) == 1 and "=" not in values[0]:
        path = values[0].strip()
        if not path:
            raise ValueError("give name=path pairs, or one adapter's path")
        return {"default": path}
    adapters: dict[str, str] = {}
    for value in values:
        name, eq, path = value.strip().partition("=")
        if not eq or not name or not path:
            raise ValueError(f"{value!r}: give each of several adapters as name=path")
        if name in adapters:
            raise ValueError(f"the adapter name {name!r} is given twice: give each adapter its own name")
        adapters[name] = path
    return adapters


class _AdaptersAction(argparse.Action):
    """Parses ``--adapters`` into a dict at parse time, so a bad value is an argparse error."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        try:
            setattr(namespace, self.dest, parse_adapters(values))
        except ValueError as exc:
            parser.error(f"argument {option_string}: {exc}")


def _positive_int(value: str) -> int:
    """An integer of at least 1 (argparse reports anything else against the flag)."""
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not an integer") from None
    if number < 1:
        raise argparse.ArgumentTypeError(f"{number} is not a positive integer")
    return number


def _http_url(value: str) -> str:
    """An ``http(s)://HOST[:PORT]`` argument, refused at parse time (not by a stage that retries it forever)."""
    from urllib.parse import urlsplit

    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise argparse.ArgumentTypeError(f"{value!r}: give it as http://HOST:PORT")
    return value.rstrip("/")


def _api_key_options(s: argparse.ArgumentParser) -> None:
    """The API key flags (``_api_keys``), shared by ``serve api_server``, ``serve stage`` and ``serve proxy``."""
    s.add_argument("--api-keys", nargs="*", default=None, help="accepted API keys (Authorization: Bearer KEY)")
    s.add_argument("--api-keys-file", default=None,
                   help=f"a file of accepted API keys, one a line (also ${API_KEYS_ENV}, comma-separated): "
                        "unlike --api-keys, not visible in ps")


def _server_options(s: argparse.ArgumentParser) -> None:
    s.add_argument("model", nargs="?", default=None,
                   help="model directory, .gguf file or hub id (default: SmolLM2-135M-Instruct)")
    s.add_argument("--server-name", default="0.0.0.0", help="the address to listen on")
    s.add_argument("--server-port", type=int, default=23333, help="the HTTP port")
    s.add_argument("--tokenizer-workers", type=int, default=1, help="tokenizer/chat-template processes")
    _api_key_options(s)
    s.add_argument("--proxy-url", type=_http_url, default=None, metavar="URL",
                   help="join this proxy (conveyor serve proxy) once serving, leave it on SIGTERM; the proxy "
                        "reaches this server at --server-name (a wildcard: this host's name)")
    s.add_argument("--proxy-admin-key-file", default=None, metavar="FILE",
                   help=f"with --proxy-url: a file whose first line is one of the proxy's admin keys, sent to join "
                        f"and leave (also the first of ${ADMIN_KEYS_ENV}); without one this server joins only a "
                        "proxy on its own host that has no admin keys")
    s.add_argument("--model-name", default=None, help="the name /v1/models reports (default: the folder name)")
    s.add_argument("--chat-template", default=None,
                   help="a built-in template name (see conveyor list) or a JSON file of ChatTemplateConfig fields")
    s.add_argument("--tool-call-parser", default=None, metavar="NAME",
                   help="how the model writes tool calls: llama3_json, hermes, internlm or mistral (vLLM's names; "
                        "LMDeploy's qwen / qwen2d5 / qwen3 / llama3 too); default: the format the chat template "
                        "renders, if conveyor knows it (else requests with tools get a 400)")
    s.add_argument("--reasoning-parser", default=None, metavar="NAME",
                   help="split a thinking model's output into reasoning_content and content: deepseek_r1 or qwen3")
    s.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR")
    s.add_argument("--max-restarts", type=int, default=5,
                   help="restarts of one stage within a minute; one more and the server exits 1 (for systemd/compose)")
    s.add_argument("--drain-timeout", type=float, default=60.0,
                   help="on SIGTERM, seconds requests in flight may run before the server stops (new ones get 503)")
    _engine_options(s)
    lim = s.add_argument_group("limits", "what one client may ask of the server (README: Limits)")
    lim.add_argument("--max-prompt-chars", type=int, default=None,
                     help="characters of a request's prompts, checked before tokenizing (default: 32 x session_len)")
    lim.add_argument("--max-prompts", type=int, default=128, help="prompts in one /v1/completions request")
    lim.add_argument("--max-sequences-per-request", type=int, default=256,
                     help="generations one request may start: n x prompts")
    lim.add_argument("--max-queued-requests", type=int, default=1024,
                     help="generations queued or running at the ingress; past it, 429 with Retry-After "
                          "(a request asking for more than this by itself: 400)")
    lim.add_argument("--request-timeout", type=float, default=600.0,
                     help="seconds a request may run before it is stopped with 504 (0: no limit)")
    lim.add_argument("--header-timeout", type=float, default=10.0,
                     help="seconds a client may take to send its request headers before the connection is closed")
    lim.add_argument("--body-timeout", type=float, default=30.0,
                     help="seconds a client may take to send its request body before it gets 408")
    lim.add_argument("--max-body-bytes", type=int, default=8 * 1024 * 1024,
                     help="bytes of a request body (images come inside as data: URLs); past it 413")
    lim.add_argument("--max-connections", type=int, default=4096,
                     help="open connections and requests; past it new requests get 503")
    lim.add_argument("--qos-config-path", default=None, metavar="FILE",
                     help="QoS user groups, LMDeploy's JSON format: a request's `user` picks its group (priority) "
                          "and quota (README: QoS)")
    img = s.add_argument_group("images", "what a vision-language model's requests may bring (README: Images)")
    img.add_argument("--max-images-per-request", type=int, default=8, help="image parts in one request")
    img.add_argument("--max-image-pixels", type=int, default=None,
                     help="width x height of one image, checked before its pixels are decoded (default: 36 million)")
    img.add_argument("--max-image-bytes", type=int, default=None,
                     help="bytes of one encoded image, a data URL's or a download's (default: 20 MiB)")
    img.add_argument("--disable-image-fetch", action="store_true",
                     help="refuse http(s) image URLs: images come as data: URLs only")
    img.add_argument("--image-fetch-timeout", type=float, default=None,
                     help="seconds one image download may take, in all (default: 10)")
    img.add_argument("--allowed-media-domains", nargs="+", default=[], metavar="HOST",
                     help="fetch image URLs (and redirects) only from these hosts and their subdomains, "
                          "e.g. to keep requests off internal addresses (default: any host)")
    # No flag: users serve LLMEngine. Tests and benchmarks put a fake engine behind the real stages
    # with conveyor.testing.serve, which adds --engine-factory to this parser.
    s.set_defaults(engine_factory=None)
    s.add_argument("--dummy-weights", default=None, metavar="SHAPE",
                   help="serve a model shape on seeded random weights, for speed benchmarks: a published shape "
                        "(llama2-7b, llama3-8b, llama2-70b, tiny) or a config.json / model directory; MODEL then "
                        "only supplies the tokenizer (prompts as token ids run as on the real model)")


def _add_serve(sub) -> None:
    serve = sub.add_parser("serve", help="serve a model over HTTP, or talk to a server")
    serve_sub = serve.add_subparsers(dest="serve_command", metavar="SERVE_COMMAND", required=True)
    s = serve_sub.add_parser("api_server", help="OpenAI-compatible server: every stage as a process")
    _server_options(s)
    s.set_defaults(func=_cmd_api_server)
    st = serve_sub.add_parser("stage", help="run one stage over tcp:// (one compose service)")
    st.add_argument("stage", choices=["ingress", "tokenizer", "engine", "detokenizer"])
    _server_options(st)
    st.add_argument("--base-port", type=int, default=5550, help="first of the stages' ZeroMQ ports")
    st.add_argument("--curve-key-file", default=None,
                    help="the deployment's CURVE keys (default: $CONVEYOR_CURVE_KEY_FILE); see serve keygen")
    k = serve_sub.add_parser("keygen", help="write the CURVE key file that the tcp:// stages share")
    k.add_argument("path")
    k.add_argument("--keep-existing", action="store_true", help="exit 0 if the file is already there (compose)")
    k.set_defaults(func=_cmd_keygen)
    st.set_defaults(func=_cmd_stage)
    c = serve_sub.add_parser("api_client", help="chat in the terminal with a running server")
    c.add_argument("api_server_url", help="e.g. http://localhost:23333")
    c.add_argument("--api-key", default=None, help="the server's API key, if it has any")
    c.add_argument("--session-id", type=int, default=None,
                   help="resume this session (default: a new one with a random id, ended on exit)")
    c.add_argument("--request-output-len", type=int, default=INTERACTIVE_DEFAULTS.max_new_tokens,
                   help="most tokens per answer")
    c.set_defaults(func=_cmd_api_client)
    g = serve_sub.add_parser("gradio", help="web chat in the browser: a model in this process, or an api_server URL")
    g.add_argument("model_path_or_server", nargs="?", default=None, metavar="MODEL_PATH_OR_API_URL",
                   help="model directory, .gguf file or hub id (default: SmolLM2-135M-Instruct), or a running "
                        "api_server's URL (http://HOST:PORT)")
    g.add_argument("--server-name", default="0.0.0.0", help="the address the web page is served on")
    g.add_argument("--server-port", type=int, default=6006, help="the web page's port")
    g.add_argument("--api-key", default=None, help="with a URL: the api_server's API key, if it has any")
    g.add_argument("--chat-template", default=None, help="with a model: a built-in template name or a JSON file")
    g.add_argument("--model-name", default=None, help=f"with a model: {_MODEL_NAME_HELP}")
    g.add_argument("--log-level", default="INFO")
    _engine_options(g)
    g.set_defaults(func=_cmd_gradio)
    p = serve_sub.add_parser("proxy", help="one OpenAI endpoint distributing requests over several api_servers")
    p.add_argument("--server-name", default="127.0.0.1",
                   help="the address to listen on (default: this host only; 0.0.0.0 for every interface)")
    p.add_argument("--server-port", type=int, default=8000, help="the HTTP port")
    p.add_argument("--strategy", "--routing-strategy", dest="strategy", default="min_expected_latency",
                   choices=["random", "min_expected_latency", "min_observed_latency"],
                   help="how a node is picked: at random weighted by speed, fewest requests in flight per speed, "
                        "or smallest recent latency")
    _api_key_options(p)
    p.add_argument("--admin-keys", nargs="*", default=None,
                   help="keys for adding and removing nodes (POST /nodes/add, /nodes/remove), none of them an "
                        "--api-keys key; without any, nodes are added and removed only from this host")
    p.add_argument("--admin-keys-file", default=None,
                   help=f"a file of admin keys, one a line (also ${ADMIN_KEYS_ENV}, comma-separated): unlike "
                        "--admin-keys, not visible in ps")
    p.add_argument("--health-interval", type=float, default=5.0,
                   help="seconds between health checks of every node (a failing node is taken out, and put back "
                        "when it passes)")
    p.add_argument("--first-byte-timeout", type=float, default=620.0,
                   help="seconds a node may take to start its answer: a whole generation for a non-streamed "
                        "request, queueing and prefill for a stream (default: 20 s past an api_server's "
                        "--request-timeout); a node past it is quarantined and the client gets 504")
    p.add_argument("--chunk-timeout", type=float, default=60.0,
                   help="seconds a node may go silent mid-answer (a stream sends an event a token); a node past it "
                        "is quarantined and the client gets an error event or 504")
    p.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR")
    p.set_defaults(func=_cmd_proxy)


# LMDeploy's chat / gradio --model-name picks the chat template, as pipeline(path, model_name) does
_MODEL_NAME_HELP = ("a built-in chat template's name, or a model name of its family (qwen-7b, internlm2-chat-7b; "
                    "see conveyor list); --chat-template wins (default: the model's own template)")


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser; each subcommand sets ``func`` to its handler (args -> exit code)."""
    from conveyor import __version__

    parser = argparse.ArgumentParser(prog="conveyor", description="Serve large language models.")
    parser.add_argument("--version", action="version", version=f"conveyor {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    p_list = sub.add_parser("list", help="list the built-in chat templates and the model families")
    p_list.set_defaults(func=_cmd_list)
    p_env = sub.add_parser("check_env", help="print the environment: Python, packages, GPUs, NCCL")
    p_env.set_defaults(func=_cmd_check_env)
    p_chat = sub.add_parser("chat", help="chat with a model in the terminal (in-process engine)")
    p_chat.add_argument("model", nargs="?", default=None,
                        help="model directory, .gguf file or hub id (default: SmolLM2-135M-Instruct)")
    p_chat.add_argument("--chat-template", default=None,
                        help="a built-in template name (see conveyor list) or a JSON file of ChatTemplateConfig fields")
    p_chat.add_argument("--model-name", default=None, help=_MODEL_NAME_HELP)
    # LMDeploy's `chat` samples as its interactive endpoint does: one definition of those defaults.
    d = INTERACTIVE_DEFAULTS
    p_chat.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens, help="most tokens per answer")
    p_chat.add_argument("--temperature", type=float, default=d.temperature, help="0 is greedy")
    p_chat.add_argument("--top-k", type=int, default=d.top_k, help="sample from the k likeliest tokens (0: all)")
    p_chat.add_argument("--top-p", type=float, default=d.top_p,
                        help="sample from the likeliest tokens up to this probability")
    _engine_options(p_chat, cache_default=0.2)
    p_chat.add_argument("--adapter-name", default=None, metavar="NAME",
                        help="the LoRA adapter (one of --adapters) the conversation runs with (default: the first "
                             "one given; none given: the base model)")
    p_chat.set_defaults(func=_cmd_chat)
    _add_serve(sub)
    add_lite_parser(sub)
    _show_defaults(parser)
    return parser


class _DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's help states its default, also an option without a help text, unless the
    help already says it (or the default is a positional's None)."""

    def _format_action(self, action: argparse.Action) -> str:
        if action.help is None and action.option_strings:
            action = _copy.copy(action)
            action.help = "default: %(default)s"
        return super()._format_action(action)

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text.lower() or (action.default is None and not action.option_strings):
            return text
        return super()._get_help_string(action)


def _show_defaults(parser: argparse.ArgumentParser) -> None:
    """Give ``parser`` and every subcommand's parser (added here or elsewhere) the defaults formatter."""
    parser.formatter_class = _DefaultsHelpFormatter
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in dict.fromkeys(action.choices.values()):
                _show_defaults(child)


def hyphenate_options(argv: Sequence[str]) -> list[str]:
    """``--server_port 8000`` / ``--server_port=8000`` -> ``--server-port ...``: LMDeploy's docs
    spell options both ways; every option here is hyphenated. Values are left alone, and so is
    everything after a bare ``--``."""
    out, rest = [], False
    for arg in argv:
        if not rest and arg.startswith("--") and len(arg) > 2:
            name, eq, value = arg.partition("=")
            arg = name.replace("_", "-") + eq + value
        rest = rest or arg == "--"
        out.append(arg)
    return out


def backend_positional(argv: Sequence[str]) -> list[str]:
    """``chat turbomind MODEL ...`` (LMDeploy 0.1's form, in its course notes) -> ``chat MODEL ...
    --backend turbomind``; a lone ``chat turbomind`` stays a model of that name."""
    argv = list(argv)
    if len(argv) > 2 and argv[0] == "chat" and argv[1] in ("turbomind", "pytorch") and not argv[2].startswith("-"):
        return ["chat", argv[2], "--backend", argv[1], *argv[3:]]
    return argv


def main(argv: Sequence[str] | None = None, parser: argparse.ArgumentParser | None = None) -> int:
    """Entry point of the ``conveyor`` console script; returns the exit code. ``parser``:
    ``build_parser()``'s, or one built on it (conveyor.testing.serve adds --engine-factory)."""
    argv = backend_positional(hyphenate_options(sys.argv[1:] if argv is None else argv))
    args = (parser or build_parser()).parse_args(argv)
    if getattr(args, "backend", None):
        print(f"conveyor: --backend {args.backend}: conveyor has one engine, which serves both", file=sys.stderr)
    try:
        return args.func(args)
    except KeyboardInterrupt:  # Ctrl-C while loading or generating: stop, without a traceback
        print("\nconveyor: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
