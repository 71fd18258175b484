"""Run every LMDeploy command of ``../shared/reference/`` with ``conveyor`` in its place.

    python scripts/lmdeploy_parity.py            # everything: servers, chats, quantization (~10 min on 2 CPUs)
    python scripts/lmdeploy_parity.py --quick    # only what exits before a model loads (~10 s; CI runs it)
    python scripts/lmdeploy_parity.py --only chat

Each case is a command as LMDeploy's docs write it, the same command with ``conveyor`` for
``lmdeploy`` (``python -m conveyor`` for ``python3 -m lmdeploy``), and what docs/lmdeploy_commands.md
records for it: ``works`` (exit 0; a server answers one chat request, a web chat serves its page, a
terminal chat answers) or ``refused`` (exits non-zero before doing anything, saying the pattern
given). The hub ids are replaced by the cached default model (no downloads here); ``./workspace``
(a TurboMind-converted folder) by the same model's directory, which conveyor reads as it is; the
quantized folders by what this script's own ``lite`` cases wrote; ports by free ones. Prints one
line a case and exits 1 when any case did not do what the table says.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
CONVEYOR = str(Path(PYTHON).with_name("conveyor"))  # the console script beside this interpreter


@dataclass
class Case:
    """One LMDeploy command: ``doc`` as written there, ``argv`` conveyor's (after ``conveyor``)."""

    doc: str
    argv: list[str]
    kind: str = "exit"  # exit | server | webchat | chat | client
    expect: str = "works"  # works | refused
    match: str = ""  # refused: a regex the message must contain; works: one the output must contain
    quick: bool = False  # finishes before any model loads
    program: str = "conveyor"  # conveyor | module (python -m conveyor) | bench (python -m benchmarks.X)


def cases(model: str, awq: str, w8: str, template: str, qos: str) -> list[Case]:
    """The table's rows, in its order. ``{port}`` is a free port, ``{url}`` the shared api_server."""
    calib = ["--calib-samples", "8", "--calib-seqlen", "128"]  # a short calibration: minutes -> seconds on a CPU
    return [
        # serve api_server
        Case("lmdeploy serve api_server internlm/internlm-7b", ["serve", "api_server", model], "server"),
        Case("lmdeploy serve api_server internlm/internlm2-chat-7b --server-port 23333",
             ["serve", "api_server", model, "--server-port", "{port}"], "server"),
        Case("lmdeploy serve api_server liuhaotian/llava-v1.6-vicuna-7b --server-port 23333",
             ["serve", "api_server", model, "--server-port", "{port}"], "server"),
        Case("lmdeploy serve api_server ./workspace --server_name 0.0.0.0 --server_port 23333 "
             "--instance_num 64 --tp 1",
             ["serve", "api_server", model, "--server_name", "0.0.0.0", "--server_port", "{port}",
              "--instance_num", "64", "--tp", "1"], expect="refused", match="--instance-num", quick=True),
        Case("lmdeploy serve api_server ./internlm2-chat-7b-4bit --backend turbomind --model-format awq",
             ["serve", "api_server", awq, "--backend", "turbomind", "--model-format", "awq"], "server"),
        Case("lmdeploy serve api_server internlm/internlm2-chat-7b --quant-policy 8",
             ["serve", "api_server", model, "--quant-policy", "8"], "server"),
        Case("lmdeploy serve api_server internlm/internlm2-chat-7b --chat-template ${JSON_FILE}",
             ["serve", "api_server", model, "--chat-template", template], "server"),
        Case("CUDA_VISIBLE_DEVICES=0 lmdeploy serve api_server internlm/internlm-chat-7b --server-port 8000 "
             "--qos-config-path lmdeploy/serve/qos_engine/qos_config.json.template",
             ["serve", "api_server", model, "--server-port", "{port}", "--qos-config-path", qos], "server"),
        Case("lmdeploy serve api_server internlm/internlm2-chat-7b --cache-max-entry-count 0.2",
             ["serve", "api_server", model, "--cache-max-entry-count", "0.2"], "server"),
        Case("lmdeploy serve api_server $repo_id --model-name $model_name --tp 1",
             ["serve", "api_server", model, "--model-name", "internlm-chat-20b", "--tp", "1"], "server",
             match="internlm-chat-20b"),
        Case("lmdeploy serve api_server ./workspace --tp 1", ["serve", "api_server", model, "--tp", "1"], "server"),
        Case("lmdeploy serve api_server ./workspace --server-name ${server_ip} --server-port ${server_port} --tp 1",
             ["serve", "api_server", model, "--server-name", "127.0.0.1", "--server-port", "{port}", "--tp", "1"],
             "server"),
        Case("gdb --args python3 -m lmdeploy serve api_server /workdir/Llama-2-13b-chat-hf",
             ["serve", "api_server", model], "server", program="module"),
        Case("lmdeploy serve api_server -h", ["serve", "api_server", "-h"], match="--cache-max-entry-count",
             quick=True),
        # serve api_client
        Case("lmdeploy serve api_client http://localhost:23333", ["serve", "api_client", "{url}"], "client"),
        Case("lmdeploy serve api_client http://0.0.0.0:23333",
             ["serve", "api_client", "{url0}"], "client"),
        # serve gradio
        Case("lmdeploy serve gradio internlm/internlm-chat-7b", ["serve", "gradio", model], "webchat"),
        Case("lmdeploy serve gradio http://localhost:23333 --server-name localhost --server-port 6006",
             ["serve", "gradio", "{url}", "--server-name", "localhost", "--server-port", "{port}"], "webchat"),
        Case("lmdeploy serve gradio http://0.0.0.0:23333 --server_name 0.0.0.0 --server_port 6006 --restful_api True",
             ["serve", "gradio", "{url0}", "--server_name", "0.0.0.0", "--server_port", "{port}", "--restful_api",
              "True"], expect="refused", match="--restful-api", quick=True),
        Case("lmdeploy serve gradio ./internlm2-chat-7b-4bit --server_name {ip_addr} --server_port {port} "
             "--model-format awq",
             ["serve", "gradio", awq, "--server_name", "127.0.0.1", "--server_port", "{port}", "--model-format",
              "awq"], "webchat"),
        Case("lmdeploy serve gradio $repo_id --model-name $model_name",
             ["serve", "gradio", model, "--model-name", "qwen-7b"], "webchat"),
        Case("lmdeploy serve gradio -h", ["serve", "gradio", "-h"], match="MODEL_PATH_OR_API_URL", quick=True),
        # serve proxy
        Case('python3 -m lmdeploy.serve.proxy.proxy --server_name {server_name} --server_port {server_port} '
             '--strategy "min_expected_latency"',
             ["serve", "proxy", "--server_name", "127.0.0.1", "--server_port", "{port}", "--strategy",
              "min_expected_latency"], "server"),
        # chat
        Case("lmdeploy chat internlm/internlm-chat-7b", ["chat", model], "chat"),
        Case("lmdeploy chat turbomind Qwen/Qwen-7B-Chat --model-name qwen-7b",
             ["chat", "turbomind", model, "--model-name", "qwen-7b"], "chat"),
        Case("lmdeploy chat turbomind ./workspace", ["chat", "turbomind", model], "chat"),
        Case("lmdeploy chat ./internlm2-chat-7b-4bit --model-format awq", ["chat", awq, "--model-format", "awq"],
             "chat"),
        Case("lmdeploy chat ./internlm-chat-7b-w8 --backend pytorch", ["chat", w8, "--backend", "pytorch"], "chat"),
        Case("lmdeploy chat internlm/internlm2-chat-7b --cache-max-entry-count 0.2",
             ["chat", model, "--cache-max-entry-count", "0.2"], "chat"),
        Case("lmdeploy chat $repo_id --model-name $model_name", ["chat", model, "--model-name", "qwen-7b"], "chat"),
        Case("lmdeploy chat turbomind /share/temp/model_repos/internlm-chat-7b/  --model-name internlm-chat-7b",
             ["chat", "turbomind", model, "--model-name", "internlm-chat-7b"], "chat"),  # loads the model since 7a4c457
        Case("lmdeploy chat ./workspace --cap completion", ["chat", model, "--cap", "completion"],
             expect="refused", match="--cap", quick=True),
        Case('lmdeploy chat ./workspace --cap chat --meta-instruct "Provide answers in Python"',
             ["chat", model, "--cap", "chat", "--meta-instruct", "Provide answers in Python"], expect="refused",
             match="--cap", quick=True),
        # lite
        Case("lmdeploy lite auto_awq $HF_MODEL --calib-dataset 'ptb' --calib-samples 128 --calib-seqlen 2048 "
             "--w-bits 4 --w-group-size 128 --batch-size 1 --search-scale False --work-dir $WORK_DIR",
             ["lite", "auto_awq", model, "--calib-dataset", "ptb", "--calib-samples", "128", "--calib-seqlen",
              "2048", "--w-bits", "4", "--w-group-size", "128", "--batch-size", "1", "--search-scale", "False",
              "--work-dir", awq + ".doc"], expect="refused", match="ptb would be unused", quick=True),
        Case("lmdeploy lite auto_awq internlm/internlm2-chat-7b --work-dir internlm2-chat-7b-4bit "
             "(+ short calibration; the group size defaults to 64 for SmolLM2)",
             ["lite", "auto_awq", model, "--work-dir", awq + ".doc", *calib]),
        Case("lmdeploy lite auto_awq internlm/internlm2-chat-7b --work-dir internlm2-chat-7b-4bit "
             "--w-group-size 128 (LMDeploy's default, said out loud)",
             ["lite", "auto_awq", model, "--work-dir", awq + ".doc", "--w-group-size", "128"], expect="refused",
             match="--w-group-size 64", quick=True),
        Case("lmdeploy lite auto_awq internlm/internlm2-chat-7b --work-dir internlm2-chat-7b-4bit "
             "(+ --w-group-size 64, short calibration)",
             ["lite", "auto_awq", model, "--work-dir", awq, "--w-group-size", "64", *calib]),
        Case("lmdeploy lite smooth_quant internlm/internlm-chat-7b --work-dir ./internlm-chat-7b-w8 "
             "(+ short calibration)", ["lite", "smooth_quant", model, "--work-dir", w8, *calib]),
        # convert, list
        Case("lmdeploy convert internlm-chat-7b /path/to/internlm-chat-7b", ["convert", "internlm-chat-7b", model],
             expect="refused", match="invalid choice: 'convert'", quick=True),
        Case("lmdeploy convert internlm internlm/internlm-7b --dst-path ./internlm-7b --trust-remote-code",
             ["convert", "internlm", model, "--dst-path", "./internlm-7b", "--trust-remote-code"], expect="refused",
             match="invalid choice: 'convert'", quick=True),
        Case("lmdeploy list", ["list"], match="internlm2", quick=True),
        # benchmark scripts
        Case("python3 profile_generation.py internlm/internlm-7b --backend pytorch",
             ["profile_generation", model, "--backend", "pytorch"], expect="refused",
             match="unrecognized arguments", quick=True, program="bench"),
        Case("python3 profile_throughput.py ./ShareGPT_V3_unfiltered_cleaned_split.json internlm/internlm-7b",
             ["profile_throughput", "./ShareGPT_V3_unfiltered_cleaned_split.json", model], expect="refused",
             match="unrecognized arguments", quick=True, program="bench"),
        Case("python3 profile_restful_api.py http://0.0.0.0:23333 internlm/internlm-7b "
             "./ShareGPT_V3_unfiltered_cleaned_split.json",
             ["profile_restful_api", "{url0}", model, "./ShareGPT_V3_unfiltered_cleaned_split.json"],
             expect="refused", match="unrecognized arguments", quick=True, program="bench"),
        Case("python3 profile_restful_api.py --server_addr 127.0.0.1:23333 --tokenizer_path ... --dataset ... "
             "--concurrency 1 --num_prompts 1",
             ["profile_restful_api", "--server_addr", "127.0.0.1:23333", "--tokenizer_path", model, "--dataset",
              "x.json", "--concurrency", "1", "--num_prompts", "1"], expect="refused",
             match="unrecognized arguments", quick=True, program="bench"),
    ]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(url: str, body: dict | None = None, timeout: float = 120) -> tuple[int, str]:
    """(status, body) of a GET, or of a POST of ``body`` as JSON; (0, reason) when nothing answers."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except OSError as exc:
        return 0, str(exc)


def command(case: Case, env_port: int, url_port: int | None) -> list[str]:
    subs = {"{port}": str(env_port), "{url}": f"http://127.0.0.1:{url_port}", "{url0}": f"http://0.0.0.0:{url_port}"}
    argv = [subs.get(a, a) for a in case.argv]
    if case.program == "bench":
        return [PYTHON, "-m", f"benchmarks.{argv[0]}", *argv[1:]]
    if case.program == "module":
        return [PYTHON, "-m", "conveyor", *argv]
    return [CONVEYOR, *argv]


class Server:
    """A started command (a server and its stage processes) in a session of its own."""

    def __init__(self, argv: list[str], log: Path) -> None:
        self.log = log
        self.proc = subprocess.Popen(argv, cwd=ROOT, stdout=log.open("w"), stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)

    def wait_http(self, url: str, timeout: float = 300) -> bool:
        end = time.monotonic() + timeout
        while time.monotonic() < end and self.proc.poll() is None:
            if http(url, timeout=5)[0] == 200:
                return True
            time.sleep(1)
        return False

    def stop(self) -> None:
        """SIGTERM to the command (it stops its own stages, as under systemd); its whole session
        is killed only if it has not exited within a minute."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-2000:]


def port_of(argv: list[str], default: int) -> int:
    """The port a server command listens on: its --server-port / --server_port, else LMDeploy's default."""
    for flag in ("--server-port", "--server_port"):
        if flag in argv:
            return int(argv[argv.index(flag) + 1])
    return default


def with_port(argv: list[str], default_port: int) -> tuple[list[str], int]:
    """A server command as written; when it names no port, one is added so that runs never collide
    (the doc's default would be 23333/6006/8000: the flag is then the one difference)."""
    if "--server-port" in argv or "--server_port" in argv:
        return argv, port_of(argv, default_port)
    port = free_port()
    return [*argv, "--server-port", str(port)], port


def run_case(case: Case, work: Path, url_port: int | None) -> tuple[str, str]:
    """(observed: works | refused | failed, the evidence line)."""
    argv = command(case, free_port(), url_port)
    log = work / f"case{abs(hash(case.doc)) % 10**8}.log"
    if case.kind == "exit":
        done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=900, stdin=subprocess.DEVNULL)
        out = done.stdout + done.stderr
        lines = [line for line in out.splitlines() if line.strip()]
        last = lines[-1] if lines else ""
        if done.returncode != 0:
            return "refused", last
        if case.match and not re.search(case.match, out):
            return "failed", f"exit 0 but no {case.match!r} in the output"
        return "works", last
    if case.kind in ("chat", "client"):
        done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=600,
                              input="Say hello in five words.\n")
        out = (done.stdout + done.stderr).strip()
        if done.returncode != 0:
            lines = out.splitlines()
            return "refused", lines[-1] if lines else f"exit {done.returncode}"
        # the answer: what is printed besides the client's banner and its "> " prompts
        answer = [line.lstrip("> ").strip() for line in done.stdout.splitlines() if not line.startswith("connected")]
        answer = [line for line in answer if line]
        return ("works", f"answered: {answer[0][:60]!r}") if answer else ("failed", f"no answer: {out[-300:]!r}")
    argv, port = with_port(argv, 23333)
    server = Server(argv, log)
    try:
        if case.kind == "webchat":
            if not server.wait_http(f"http://127.0.0.1:{port}/"):
                lines = server.tail().strip().splitlines()
                return ("refused" if server.proc.poll() else "failed"), lines[-1] if lines else "no output"
            return "works", "GET / 200"
        proxy = "proxy" in argv
        if not server.wait_http(f"http://127.0.0.1:{port}{'/nodes/status' if proxy else '/v1/models'}"):
            lines = server.tail().strip().splitlines()
            return ("refused" if server.proc.poll() else "failed"), lines[-1] if lines else "no output"
        if proxy:  # the request below goes through the proxy to the shared api_server
            status, text = http(f"http://127.0.0.1:{port}/nodes/add", {"url": f"http://127.0.0.1:{url_port}"})
            if status != 200:
                return "failed", f"/nodes/add {status}: {text[:200]}"
        models = json.loads(http(f"http://127.0.0.1:{port}/v1/models")[1])["data"]
        name = models[0]["id"]
        if case.match and not re.search(case.match, name):
            return "failed", f"serves {name!r}"
        body = {"model": name, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 16,
                "user": "alice"}
        status, text = http(f"http://127.0.0.1:{port}/v1/chat/completions", body)
        if status != 200:
            return "failed", f"chat completion {status}: {text[:200]}"
        reply = json.loads(text)["choices"][0]["message"]["content"]
        return "works", f"model {name!r} answered {reply[:40]!r}"
    finally:
        server.stop()


def write_inputs(work: Path) -> tuple[str, str]:
    """The JSON files the docs' commands name: a chat template (LMDeploy's example) and a QoS config."""
    template = work / "template.json"
    template.write_text(json.dumps({"model_name": "customized_model", "system": "<|im_start|>system\n",
                                    "meta_instruction": "You are a robot developed by LMDeploy.",
                                    "eosys": "<|im_end|>\n", "user": "<|im_start|>user\n", "eoh": "<|im_end|>\n",
                                    "assistant": "<|im_start|>assistant\n", "eoa": "<|im_end|>",
                                    "separator": "\n", "capability": "chat", "stop_words": ["<|im_end|>"]}))
    qos = work / "qos.json"
    qos.write_text(json.dumps({"enable_user_qos": True, "user_groups": ["Platinum", "Gold", "Silver", "Bronze"],
                               "user_group_map": {
                                   "Platinum": [{"id": "user_id0", "quota_pct": 100}, {"id": "default",
                                                                                       "quota_pct": 0}],
                                   "Gold": [{"id": "user_id1", "quota_pct": 50}, {"id": "user_id2",
                                                                                   "quota_pct": 50}],
                                   "Silver": [{"id": "user_id3", "quota_pct": 5}, {"id": "default",
                                                                                   "quota_pct": 95}],
                                   "Bronze": [{"id": "user_id4", "quota_pct": 100}]}}))
    return str(template), str(qos)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="only the cases that exit before a model loads")
    parser.add_argument("--only", default=None, help="only the cases whose LMDeploy command contains this")
    parser.add_argument("--keep", action="store_true", help="keep the work dir (logs, quantized models)")
    parser.add_argument("--model", default=None, help="the model the hub ids become (default: the cached SmolLM2)")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    from conveyor.default_model import fetch

    model = args.model or str(fetch())
    work = Path(tempfile.mkdtemp(prefix="lmdeploy_parity_"))
    template, qos = write_inputs(work)
    table = cases(model, str(work / "internlm2-chat-7b-4bit"), str(work / "internlm-chat-7b-w8"), template, qos)
    chosen = [c for c in table if (c.quick or not args.quick) and (not args.only or args.only in c.doc)]
    needs_url = any("{url}" in c.argv or "{url0}" in c.argv or "proxy" in c.argv for c in chosen if not c.quick)
    shared, url_port = None, 23333  # quick cases only print the URL in a refusal
    if needs_url:  # the clients' and the web chat's api_server
        url_port = free_port()
        shared = Server([CONVEYOR, "serve", "api_server", model,
                         "--server-port", str(url_port)], work / "shared_server.log")
        if not shared.wait_http(f"http://127.0.0.1:{url_port}/v1/models"):
            print(shared.tail(), file=sys.stderr)
            shared.stop()
            return 1
    # the lite cases write the quantized models the serve/chat cases load: run them first
    chosen.sort(key=lambda c: not c.argv[0] == "lite")
    def judge(case: Case) -> tuple[bool, str]:
        """(as the table says, the report lines) of one case."""
        started = time.monotonic()
        try:
            observed, evidence = run_case(case, work, url_port)
        except subprocess.TimeoutExpired:
            observed, evidence = "failed", "timed out"
        if observed == "refused" and case.match and not re.search(case.match, evidence):
            evidence = f"{evidence} (expected a message matching {case.match!r})"
            observed = "failed"
        ok = observed == case.expect
        return ok, (f"{'ok ' if ok else 'BAD'} {observed:<8} {time.monotonic() - started:5.0f}s  {case.doc}\n"
                    f"{'':14}{evidence}")

    bad = 0
    # Quick cases are independent processes that exit at once: one a core at a time. Others run in
    # order (the lite cases write the models that later cases load). Reported in the table's order.
    workers = (os.cpu_count() or 2) if all(c.quick for c in chosen) else 1
    try:
        with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
            for ok, report in pool.map(judge, chosen):
                bad += not ok
                print(report, flush=True)
    finally:
        if shared:
            shared.stop()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print(f"{len(chosen) - bad} of {len(chosen)} as docs/lmdeploy_commands.md records"
          + (f" (work dir {work})" if args.keep else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
