"""The command line takes LMDeploy's commands after the program name changes."""

from __future__ import annotations

import pytest

from conveyor.cli import _engine_config, build_parser, hyphenate_options, main
from conveyor.testing.server_process import free_port


def _parse(*argv: str):
    return build_parser().parse_args(hyphenate_options(list(argv)))


def test_options_in_both_spellings() -> None:
    a = _parse("serve", "api_server", "m", "--server_port", "8000", "--cache_max_entry_count=0.5",
               "--enable_prefix_caching", "--server-name", "127.0.0.1", "--tp", "2")
    assert (a.server_port, a.cache_max_entry_count, a.enable_prefix_caching, a.server_name, a.tp) == \
        (8000, 0.5, True, "127.0.0.1", 2)
    # values and everything after a bare -- stay as written
    assert hyphenate_options(["--chat_template", "my_template", "--", "--keep_me"]) == \
        ["--chat-template", "my_template", "--", "--keep_me"]


def test_backend_is_accepted_and_said_to_select_the_one_engine(capsys) -> None:
    assert _parse("serve", "api_server", "m", "--backend", "turbomind").backend == "turbomind"
    assert _parse("chat", "m", "--backend", "pytorch").backend == "pytorch"
    with pytest.raises(SystemExit):
        _parse("chat", "m", "--backend", "vllm")
    assert "not-an-option" not in capsys.readouterr().err


def test_chat_takes_the_engine_flags_api_server_takes() -> None:
    engine_flags = {"--tp", "--session-len", "--max-batch-size", "--cache-max-entry-count", "--cache-block-seq-len",
                    "--enable-prefix-caching", "--max-prefill-token-num", "--quant-policy", "--model-format",
                    "--dtype", "--device", "--session-idle-timeout", "--backend"}
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices
    serve = next(a for a in sub["serve"]._actions if a.dest == "serve_command").choices["api_server"]

    def flags(p):
        return {o for a in p._actions for o in a.option_strings}

    assert engine_flags <= flags(sub["chat"]) and engine_flags <= flags(serve)
    cfg = _engine_config(_parse("chat", "m", "--quant-policy", "8", "--max-batch-size", "4", "--session-len", "100",
                                "--cache-max-entry-count", "16"))
    assert (cfg.quant_policy, cfg.max_batch_size, cfg.session_len, cfg.cache_max_entry_count) == (8, 4, 100, 16)


def test_check_env_prints_the_packages_and_devices(capsys) -> None:
    assert main(["check_env"]) == 0
    out = capsys.readouterr().out
    for key in ("python", "torch", "transformers", "pyzmq", "msgspec", "CUDA", "NCCL"):
        assert any(line.startswith(key) for line in out.splitlines()), key


@pytest.mark.parametrize("text, kind, value", [("2000", "blocks", 2000), ("1", "blocks", 1), ("0.8", "fraction", 0.8),
                                               ("1.0", "fraction", 1.0), ("4GiB", "bytes", 4 * 2**30)])
def test_cache_max_entry_count_means_the_same_on_every_command(text, kind, value) -> None:
    from conveyor.engine.config import parse_cache_size

    for argv in (["serve", "api_server", "m"], ["chat", "m"]):
        cfg = _engine_config(_parse(*argv, "--cache-max-entry-count", text))
        assert cfg.cache_bytes_or_blocks() == (kind, value)
    assert _parse("chat", "m", "--cache-max-entry-count", text).cache_max_entry_count == parse_cache_size(text)


def test_version_and_every_option_shows_its_default(capsys) -> None:
    from conveyor import __version__

    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.strip() == f"conveyor {__version__}"

    def parsers(p):
        yield p
        for a in p._actions:
            if a.dest in ("command", "serve_command") or a.__class__.__name__ == "_SubParsersAction":
                for child in dict.fromkeys(a.choices.values()):
                    yield from parsers(child)

    seen = 0
    for p in parsers(build_parser()):
        for a in p._actions:
            if a.option_strings and a.dest not in ("help", "version"):
                block = p._get_formatter()._format_action(a)  # the option's lines in --help
                assert "default" in block.lower(), f"{p.prog} {a.option_strings[-1]}: {block!r}"
                seen += 1
    assert seen > 60  # every command's parser was visited


def test_a_port_in_use_is_refused_before_any_model_loads(monkeypatch, capsys) -> None:
    import socket

    import conveyor.default_model

    monkeypatch.setattr(conveyor.default_model, "fetch", lambda *a, **k: pytest.fail("loaded a model"))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["serve", "api_server", "--server-name", "127.0.0.1", "--server-port", str(port)]) == 1
    err = capsys.readouterr().err
    assert f"127.0.0.1:{port}" in err and "--server-port" in err


def test_ctrl_c_is_a_message_not_a_traceback(monkeypatch, capsys) -> None:
    import conveyor.cli as cli

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_cmd_list", interrupted)
    assert main(["list"]) == 130
    assert "interrupted" in capsys.readouterr().err


def test_lmdeploy_01_chat_form_names_the_backend_first() -> None:
    from conveyor.cli import backend_positional

    assert backend_positional(["chat", "turbomind", "m", "--model-name", "qwen-7b"]) == \
        ["chat", "m", "--backend", "turbomind", "--model-name", "qwen-7b"]
    # a model folder called turbomind, and other commands, stay as written
    for argv in (["chat", "turbomind"], ["chat", "turbomind", "--tp", "1"], ["serve", "api_server", "turbomind", "m"]):
        assert backend_positional(argv) == argv



def test_chat_model_name_picks_the_chat_template_as_lmdeploy(monkeypatch, capsys) -> None:
    import io

    import conveyor
    import conveyor.default_model

    monkeypatch.setattr(conveyor.default_model, "local_path", lambda model, say=None: model)
    monkeypatch.setattr("sys.stdin", io.StringIO(""))  # no prompt: the chat ends at once
    # the real pipeline() refuses a name of no built-in template before it loads anything
    assert main(["chat", "no/such/model", "--model-name", "no-such-chat-7b"]) == 2
    assert "'no-such-chat-7b' names no built-in chat template" in capsys.readouterr().err
    calls = []

    class Pipe:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return None

        def session(self):
            return None

    monkeypatch.setattr(conveyor, "pipeline", lambda model, config, **kw: calls.append((model, kw)) or Pipe())
    assert main(["chat", "turbomind", "m", "--model-name", "qwen-7b"]) == 0
    assert calls == [("m", {"chat_template_config": None, "model_name": "qwen-7b"})]


def test_api_server_refuses_an_unsupported_architecture_before_starting_stages(tmp_path, monkeypatch, capsys) -> None:
    import json
    import socket

    import conveyor.services.launcher as launcher

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"],
                                                      "model_type": "gpt2"}))
    monkeypatch.setattr(launcher, "serve", lambda *a, **k: pytest.fail("started the stages"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert main(["serve", "api_server", str(tmp_path), "--server-name", "127.0.0.1", "--server-port", str(port)]) == 2
    assert "['GPT2LMHeadModel'] is not supported" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["api_server", "gradio"])
def test_a_taken_port_is_refused_before_any_model_loads(command: str, capsys) -> None:
    import socket

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        # No such model: the port check comes first, so the message is about the port.
        assert main(["serve", command, "/no/such/model", "--server-name", "127.0.0.1",
                     "--server-port", str(port)]) == 1
    err = capsys.readouterr().err
    assert f"cannot serve on 127.0.0.1:{port}" in err and "--server-port" in err


def test_api_server_with_a_missing_model_exits_2_with_one_line_in_seconds() -> None:
    """A real process: no stage starts, nothing is taken for a hub id, no traceback."""
    import subprocess
    import sys
    import time
    from pathlib import Path

    conveyor = Path(sys.executable).with_name("conveyor")
    start = time.monotonic()
    done = subprocess.run([str(conveyor), "serve", "api_server", "/nonexistent", "--server-name", "127.0.0.1",
                           "--server-port", str(free_port())], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == [
        "conveyor: model path '/nonexistent' does not exist: give a Hugging Face model directory "
        "(config.json + weights), a .gguf file or a hub id like 'org/name'"]
    assert time.monotonic() - start < 10


@pytest.mark.parametrize("problem, flags, message", [
    ("cut", [], "model.safetensors is not a readable safetensors file"),
    ("missing", [], r"missing parameters \(1\): model.layers.0.self_attn.qkv_proj.weight\[q\]"),
    ("none", ["--tp", "3", "--device", "cpu"], r"num_attention_heads \(4\) does not split evenly over tp=3"),
], ids=["weights-cut-short", "tensor-missing", "tp-split"])
def test_api_server_checks_weights_and_tp_before_starting_stages(tmp_path, monkeypatch, capsys, problem, flags,
                                                                 message) -> None:
    import re

    import conveyor.services.launcher as launcher
    from test_preflight import dense_model

    model = dense_model(tmp_path)
    weights = model / "model.safetensors"
    if problem == "cut":
        weights.write_bytes(weights.read_bytes()[:-64])
    elif problem == "missing":
        from safetensors.torch import load_file, save_file

        tensors = load_file(str(weights))
        del tensors["model.layers.0.self_attn.q_proj.weight"]
        save_file(tensors, str(weights))
    monkeypatch.setattr(launcher, "serve", lambda *a, **k: pytest.fail("started the stages"))
    argv = ["serve", "api_server", str(model), "--server-name", "127.0.0.1", "--server-port", str(free_port())]
    assert main([*argv, *flags]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and re.search(message, err), err


def test_api_server_still_starts_dummy_weights_and_factory_engines(tmp_path, monkeypatch) -> None:
    import conveyor.services.launcher as launcher
    from conveyor.testing import serve as serve_fake
    from test_preflight import dense_model

    model = dense_model(tmp_path)
    (model / "model.safetensors").unlink()  # neither reads weights
    (model / "tokenizer_config.json").write_text("{}")  # --dummy-weights takes the tokenizer files of MODEL
    started = []
    monkeypatch.setattr(launcher, "serve", lambda args: started.append(args) or 0)
    base = ["serve", "api_server", str(model), "--server-name", "127.0.0.1", "--device", "cpu"]
    assert main([*base, "--server-port", str(free_port()), "--dummy-weights", "tiny"]) == 0
    # The engine factory is the test entry's flag (conveyor.testing.serve), not the product's.
    assert serve_fake.main([*base[1:], "--server-port", str(free_port())]) == 0
    assert [a.engine.load_format for a in started] == ["dummy", "auto"]
    assert [a.engine_factory for a in started] == [None, serve_fake.FAKE_ENGINE]
    with pytest.raises(SystemExit):
        main([*base, "--server-port", str(free_port()), "--engine-factory", serve_fake.FAKE_ENGINE])


def test_the_execution_flags_reach_the_engine_config() -> None:
    """The settings that were environment variables are EngineConfig fields with flags."""
    from conveyor.engine.config import EngineConfig

    cfg = _engine_config(_parse("serve", "api_server", "m"))
    plain = EngineConfig()
    assert (cfg.eager_mode, cfg.kernels, cfg.tp_all_reduce, cfg.tp_hang_timeout) == \
        (plain.eager_mode, plain.kernels, plain.tp_all_reduce, plain.tp_hang_timeout)
    cfg = _engine_config(_parse("chat", "m", "--eager-mode", "--kernels", "ref", "--tp-all-reduce", "one_shot",
                                "--tp-hang-timeout", "5"))
    assert (cfg.eager_mode, cfg.kernels, cfg.tp_all_reduce, cfg.tp_hang_timeout) == (True, "ref", "one_shot", 5.0)
    with pytest.raises(SystemExit):
        _parse("chat", "m", "--kernels", "cuda")


def test_the_image_flags_reach_the_tokenizer_stage_limits() -> None:
    from conveyor.cli import _image_limits

    args = _parse("serve", "api_server", "m", "--max-images-per-request", "3", "--max-image-bytes", "1000",
                 "--image-fetch-timeout", "2.5", "--allowed-media-domains", "images.example.com", "cdn.example.org")
    limits = _image_limits(args)
    assert (limits.max_images, limits.max_bytes, limits.fetch_timeout_s) == (3, 1000, 2.5)
    assert limits.allowed_hosts == ("images.example.com", "cdn.example.org") and limits.allow_remote
    assert _image_limits(_parse("serve", "api_server", "m", "--disable-image-fetch")).allow_remote is False
    assert _image_limits(_parse("serve", "api_server", "m")).allowed_hosts == ()
