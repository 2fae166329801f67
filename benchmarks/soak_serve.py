"""A soak of vLLM's OpenAI-compatible server with probkv: mixed hostile traffic, then exact
post-checks (issue 52). Exits non-zero on any failure.

One server (127.0.0.1, a free port; ``--dtype float32 --enforce-eager --block-size 32``,
prefix caching on, chunked prefill of ``--max-num-batched-tokens`` rows, a KV cap of
``--kv-blocks`` blocks, ``--max-model-len``; probkv's option snapkv r = 0.5 with log-weights,
so ``prob:`` requests run too, and a report file; ``--attention-backend``: ``CPU_ATTN``, the
CPU platform's own, or ``FLEX_ATTENTION``, vLLM's portable one) is started and waited for on
/health. Before the traffic, a fixed set of greedy probes (three methods over one prompt) and
the seeded references (each seeded prompt and seed alone, sampled at temperature 0.8) are
answered one at a time. Then
``--threads`` client threads send requests until ``--requests`` were sent or ``--duration``
seconds passed, each request of one kind, in a seeded shuffled round-robin (``KINDS``):

- ``topk``, ``prob``, ``budget``: greedy probes with per-request methods, ratios and decode
  budgets in flat ``vllm_xargs``; the answer must equal the probe's answer before the traffic;
- ``long_output``: the probe prompt's first 128 tokens with ``snapkv`` r = 0.5 and
  ``--long-tokens`` new tokens: vLLM admits a request only if its whole prompt fits, so it is
  output that outgrows a small cap, and a short prompt lets several long outputs in at once;
  they make vLLM preempt (and recompute) evicted requests; the answer must equal the same
  request's alone, before the traffic;
- ``stream_closed``: a stream the client closes after two chunks;
- ``n2``: ``n = 2`` with a seed: the two choices must equal the references of seeds s and
  s + 1 (vLLM seeds child i of a parallel request with seed + i);
- ``logprobs``: greedy with ``logprobs = 2``; ``seeded``: must equal its reference;
  ``unseeded``: sampled without a seed; ``shared_prefix``: one document, distinct questions;
  ``one_token``: a one-token prompt;
- ``too_long``: a prompt over max_model_len: a 400 naming the limit; ``bad_option``: each
  kind of bad probkv option in turn: a 400 naming the bad value.

The seeded prompts are longer than a prefill chunk: vLLM 0.32 on CPU killed its engine core for
them ("CPU Generator does not use offset"). After the traffic, checked and printed: every good
request answered (and equal to its reference where it has one), every bad one a 4xx naming the
reason, every KV block back in the pool (``vllm:kv_cache_usage_perc`` exactly 0: prefix-cached
blocks count as free), nothing running or waiting, /health 200, the probes answering exactly
as before, the server process alive, every report row naming the backend asked for; and the
count of each kind and of vLLM's preemptions (``--min-per-kind``, ``--min-preemptions``: fewer
is a failure too). Run under
``flock /tmp/bench.lock`` on a shared machine:

    .venv-vllm/bin/python benchmarks/soak_serve.py --requests 480 --duration 900 \\
        --min-per-kind 20 --min-preemptions 10
"""

import argparse
import collections
import json
import random
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HOST = "127.0.0.1"
BLOCK = 32
BLOCK_BYTES = 30 * 3 * 64 * 2 * 4 * BLOCK  # SmolLM2 float32
# CPU_ATTN holds prob: log-weights in spare key columns (64 -> 80 wide), FLEX beside the cache
BACKENDS = {"CPU_ATTN": 80 / 64, "FLEX_ATTENTION": 1.0}
WORDS = ["harbour", "lamp", "tide", "gull", "rope", "keeper", "stone", "wind", "salt", "night"]
KINDS = (
    "topk", "prob", "budget", "stream_closed", "n2", "logprobs", "seeded", "unseeded",
    "shared_prefix", "one_token", "too_long", "bad_option", "long_output",
)  # fmt: skip
PROBES = {  # kind -> vllm_xargs of a greedy probe
    "topk": {"probkv_method": "tova", "probkv_ratio": 0.5},
    "prob": {"probkv_method": "prob:snapkv", "probkv_ratio": 0.75},
    "budget": {"probkv_method": "snapkv", "probkv_max_entries": 128, "probkv_every": 32},
}
LONG = {"probkv_method": "snapkv", "probkv_ratio": 0.5}  # vllm_xargs of a long greedy output
BAD = [  # (vllm_xargs, what the 400's message names)
    ({"probkv_method": "no-such-method"}, "no-such-method"),
    ({"probkv_method": "kvzip"}, "repeat the context"),
    ({"probkv_method": "snapkv/block=16"}, "block=16"),
    ({"probkv_ratio": "half"}, "probkv_ratio must be a number"),
    ({"probkv_ratio": 1.5}, "1.5"),
    ({"probkv_rato": 0.5}, "probkv_rato"),
    ({"probkv_method": "prob:snapkv", "probkv_max_entries": 128}, "prob: methods"),
    ({"probkv_method": "snapkv", "probkv_max_entries": 8}, "max_entries=8"),
]
SAMPLED = {"temperature": 0.8, "top_p": 0.95}


def text(seed: int, words: int) -> str:
    return " ".join(WORDS[(seed * 7 + i * i) % len(WORDS)] for i in range(words))


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m", help="a probkv model name or a folder")
    ap.add_argument("--requests", type=int, default=480, help="at most this many requests")
    ap.add_argument("--duration", type=float, default=900.0, help="at most this many seconds")
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--kv-blocks", type=int, default=64, help="the KV cap, in blocks of 32")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--max-num-batched-tokens", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=48, help="new tokens of a good request")
    ap.add_argument(
        "--long-tokens",
        type=int,
        default=320,
        help="new tokens of a long_output request (several of them outgrow a small cap)",
    )
    ap.add_argument("--seeded-prompts", type=int, default=3, help="each with 2x as many seeds")
    ap.add_argument("--min-per-kind", type=int, default=1)
    ap.add_argument("--min-preemptions", type=int, default=0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--start-timeout", type=float, default=600.0)
    ap.add_argument("--request-timeout", type=float, default=600.0)
    ap.add_argument(
        "--attention-backend",
        choices=list(BACKENDS),
        default="CPU_ATTN",
        help="the backend the server evicts through (vLLM's --attention-backend where not "
        "CPU_ATTN, the CPU platform's own); the plugin's report rows must name it",
    )
    ap.add_argument("--log", help="the server's log (default: a file in /tmp)")
    return ap.parse_args(argv)


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def get(url: str, timeout: float = 10.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def post(url: str, body: dict, timeout: float) -> tuple[int, dict]:
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        raw = err.read().decode()
        try:
            return err.code, json.loads(raw)
        except json.JSONDecodeError:
            return err.code, {"raw": raw}


def metric(metrics: str, name: str) -> float | None:
    """The sum of a Prometheus metric's samples (None: not exported)."""
    values = [
        float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith(name + "{") or line.startswith(name + " ")
    ]
    return sum(values) if values else None


def start_server(args, model: str, port: int, log: Path, report: Path) -> subprocess.Popen:
    option = {
        "probkv": {"method": "snapkv", "ratio": 0.5, "log_weights": True, "report": str(report)}
    }
    wide = BACKENDS[args.attention_backend]
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
        "--host", HOST, "--port", str(port), "--dtype", "float32", "--enforce-eager",
        "--block-size", str(BLOCK), "--enable-prefix-caching",
        "--max-model-len", str(args.max_model_len),
        "--max-num-batched-tokens", str(args.max_num_batched_tokens),
        "--kv-cache-memory-bytes", str(int(args.kv_blocks * BLOCK_BYTES * wide)),
        "--seed", "0", "--additional-config", json.dumps(option),
    ]  # fmt: skip
    if args.attention_backend != "CPU_ATTN":
        command += ["--attention-backend", args.attention_backend]
    with open(log, "w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + args.start_timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode}: see {log}")
        try:
            if get(f"http://{HOST}:{port}/health", 5)[0] == 200:
                return process
        except OSError:
            pass
        time.sleep(2)
    process.kill()
    raise RuntimeError(f"the server did not start within {args.start_timeout} s: see {log}")


class Traffic:
    """The prompts, references and results of one soak (module docstring)."""

    def __init__(self, args, base: str, model: str, tokenizer, report: Path) -> None:
        self.args, self.base, self.model, self.report = args, base, model, report
        self.lock = threading.Lock()
        self.counts: collections.Counter = collections.Counter()
        self.failures: list[str] = []
        ids = lambda s: tokenizer(s).input_ids  # noqa: E731
        self.probe_prompt = ids(text(3, 500))[:600]
        self.seeded_prompts = [ids(text(10 + i, 500))[:700] for i in range(args.seeded_prompts)]
        self.document = ids(text(21, 500))[:512]
        self.questions = [ids(f" Question {i}: which word came first?") for i in range(40)]
        self.too_long = ids(text(5, 1500))[: args.max_model_len + 64]
        self.references: dict = {}

    def complete(self, prompt, *, xargs=None, max_tokens=None, **fields) -> tuple[int, dict]:
        body = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": max_tokens or self.args.max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            **fields,
        }
        if xargs is not None:
            body["vllm_xargs"] = xargs
        return post(f"{self.base}/v1/completions", body, self.args.request_timeout)

    def answers(self, prompt, **kw) -> list[str] | None:
        status, body = self.complete(prompt, **kw)
        if status != 200:
            return None
        return [c["text"] for c in sorted(body["choices"], key=lambda c: c["index"])]

    def probes(self) -> dict:
        """The greedy probes' answers, one request at a time."""
        return {kind: self.answers(self.probe_prompt, xargs=x) for kind, x in PROBES.items()}

    def take_references(self) -> None:
        self.references["probes"] = self.probes()
        self.references["long"] = self.long_output()
        for i, prompt in enumerate(self.seeded_prompts):
            for seed in range(2 * len(self.seeded_prompts)):
                self.references[i, seed] = self.answers(prompt, seed=seed, **SAMPLED)

    def fail(self, kind: str, why: str) -> None:
        with self.lock:
            self.failures.append(f"{kind}: {why}")

    def send(self, number: int, kind: str) -> None:
        try:
            why = getattr(self, f"kind_{kind}")(number)
        except Exception as err:  # a dropped connection, a timeout: the server failed it
            why = f"{type(err).__name__}: {err}"
        with self.lock:
            self.counts[kind] += 1
        if why:
            self.fail(kind, f"request {number}: {why}")

    def expect(self, got, want, what: str) -> str | None:
        if got is None:
            return f"{what}: not answered"
        return None if got == want else f"{what}: {got!r} != {want!r}"

    def kind_topk(self, n: int) -> str | None:
        want = self.references["probes"]["topk"]
        return self.expect(self.answers(self.probe_prompt, xargs=PROBES["topk"]), want, "topk")

    def kind_prob(self, n: int) -> str | None:
        want = self.references["probes"]["prob"]
        return self.expect(self.answers(self.probe_prompt, xargs=PROBES["prob"]), want, "prob")

    def kind_budget(self, n: int) -> str | None:
        want = self.references["probes"]["budget"]
        got = self.answers(self.probe_prompt, xargs=PROBES["budget"])
        return self.expect(got, want, "budget")

    def long_output(self) -> list[str] | None:
        prompt = self.probe_prompt[:128]  # admitted whole (vLLM 0.32 reserves the full input)
        return self.answers(prompt, xargs=LONG, max_tokens=self.args.long_tokens)

    def kind_long_output(self, n: int) -> str | None:
        return self.expect(self.long_output(), self.references["long"], "long_output")

    def kind_seeded(self, n: int) -> str | None:
        i, seed = n % len(self.seeded_prompts), n % (2 * len(self.seeded_prompts))
        got = self.answers(self.seeded_prompts[i], seed=seed, **SAMPLED)
        return self.expect(got, self.references[i, seed], f"prompt {i} seed {seed}")

    def kind_n2(self, n: int) -> str | None:
        i, seed = n % len(self.seeded_prompts), 2 * (n % len(self.seeded_prompts))
        got = self.answers(self.seeded_prompts[i], seed=seed, n=2, **SAMPLED)
        want = self.references[i, seed] + self.references[i, seed + 1]
        return self.expect(got, want, f"n=2 prompt {i} seeds {seed}, {seed + 1}")

    def kind_unseeded(self, n: int) -> str | None:
        prompt = self.seeded_prompts[n % len(self.seeded_prompts)]
        got = self.answers(prompt, xargs=PROBES["topk"], **SAMPLED)
        return None if got and got[0] else "not answered"

    def kind_logprobs(self, n: int) -> str | None:
        status, body = self.complete(self.probe_prompt[: 200 + n % 300], logprobs=2)
        if status != 200:
            return f"status {status}: {body}"
        logprobs = body["choices"][0]["logprobs"]
        if len(logprobs["token_logprobs"]) != self.args.max_tokens:
            return f"{len(logprobs['token_logprobs'])} logprobs"
        return None

    def kind_shared_prefix(self, n: int) -> str | None:
        prompt = self.document + self.questions[n % len(self.questions)]
        got = self.answers(prompt, xargs={"probkv_method": "snapkv", "probkv_ratio": 0.5})
        return None if got and got[0] else "not answered"

    def kind_one_token(self, n: int) -> str | None:
        got = self.answers([self.probe_prompt[n % 50]], max_tokens=8)
        return None if got and got[0] else "not answered"

    def kind_stream_closed(self, n: int) -> str | None:
        body = {
            "model": self.model, "prompt": self.probe_prompt[: 300 + n % 200],
            "max_tokens": 200, "temperature": 0, "ignore_eos": True, "stream": True,
        }  # fmt: skip
        request = urllib.request.Request(
            f"{self.base}/v1/completions",
            json.dumps(body).encode(),
            {"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=self.args.request_timeout) as response:
            chunks = 0
            for line in response:
                chunks += line.startswith(b"data:")
                if chunks == 2:
                    return None  # the client goes away mid-stream
        return "the stream ended before two chunks"

    def kind_too_long(self, n: int) -> str | None:
        status, body = self.complete(self.too_long)
        message = json.dumps(body)
        if status != 400 or str(self.args.max_model_len) not in message:
            return f"status {status}, expected a 400 naming {self.args.max_model_len}: {message}"
        return None

    def kind_bad_option(self, n: int) -> str | None:
        xargs, reason = BAD[n % len(BAD)]
        status, body = self.complete(self.probe_prompt[:100], xargs=xargs, max_tokens=4)
        message = json.dumps(body)
        if not 400 <= status < 500 or reason not in message:
            return f"{xargs}: status {status}, expected a 4xx naming {reason!r}: {message}"
        return None


def schedule(args) -> list[str]:
    rng = random.Random(args.seed)
    rounds = -(-args.requests // len(KINDS))
    kinds = []
    for _ in range(rounds):
        one = list(KINDS)
        rng.shuffle(one)
        kinds += one
    return kinds[: args.requests]


def run_traffic(args, traffic: Traffic) -> float:
    deadline = time.monotonic() + args.duration
    started = time.monotonic()

    def worker(start: int) -> None:
        for number in range(start, args.requests, args.threads):
            if time.monotonic() > deadline:
                return
            traffic.send(number, kinds[number])

    kinds = schedule(args)
    with ThreadPoolExecutor(max_workers=args.threads) as pool:
        for future in [pool.submit(worker, t) for t in range(args.threads)]:
            future.result()
    return time.monotonic() - started


def post_checks(args, traffic: Traffic, process: subprocess.Popen) -> dict:
    """The exact checks after the traffic (module docstring); failures go to traffic.fail."""
    base = traffic.base
    settle = time.monotonic() + 60  # closed streams are aborted on the server's next steps
    while True:
        _, metrics = get(f"{base}/metrics")
        busy = [metric(metrics, f"vllm:num_requests_{s}") for s in ("running", "waiting")]
        usage = metric(metrics, "vllm:kv_cache_usage_perc")
        if (busy == [0, 0] and usage == 0) or time.monotonic() > settle:
            break
        time.sleep(1)
    checks = {
        "running": busy[0],
        "waiting": busy[1],
        "kv_cache_usage": usage,
        "preemptions": metric(metrics, "vllm:num_preemptions_total"),
        "health": get(f"{base}/health")[0],
        "alive": process.poll() is None,
    }
    if busy != [0, 0]:
        traffic.fail("post", f"requests left: running {busy[0]}, waiting {busy[1]}")
    if usage != 0:
        traffic.fail("post", f"KV blocks not back in the pool: usage {usage}")
    if checks["health"] != 200 or not checks["alive"]:
        traffic.fail("post", f"health {checks['health']}, process alive {checks['alive']}")
    probes = traffic.probes()
    checks["probes_unchanged"] = probes == traffic.references["probes"]
    if not checks["probes_unchanged"]:
        traffic.fail("post", f"probes changed: {probes} != {traffic.references['probes']}")
    for kind in KINDS:
        if traffic.counts[kind] < args.min_per_kind:
            traffic.fail("post", f"{kind} sent {traffic.counts[kind]} < {args.min_per_kind} times")
    if (checks["preemptions"] or 0) < args.min_preemptions:
        traffic.fail("post", f"{checks['preemptions']} preemptions < {args.min_preemptions}")
    checks["backends"] = backends = reported_backends(traffic.report)
    if backends != [args.attention_backend]:
        traffic.fail("post", f"evictions ran through {backends}, not {args.attention_backend}")
    return checks


def reported_backends(report: Path) -> list[str]:
    """The attention backends the plugin's report rows name (one row per eviction)."""
    if not report.exists():
        return []
    rows = [json.loads(x) for x in report.read_text().splitlines() if x.strip()]
    return sorted({str(r.get("attention_backend")) for r in rows})


def main(argv=None) -> int:
    args = parse_args(argv)
    from probkv.models import load_tokenizer, resolve_model

    model = str(resolve_model(args.model).path)
    tokenizer = load_tokenizer(args.model)
    port = free_port()
    log = Path(args.log or f"/tmp/soak_serve_{port}.log")
    report = log.with_suffix(".report.jsonl")
    report.unlink(missing_ok=True)
    t0 = time.monotonic()
    process = start_server(args, model, port, log, report)
    print(f"server up in {time.monotonic() - t0:.0f} s (log {log})", flush=True)
    try:
        traffic = Traffic(args, f"http://{HOST}:{port}", model, tokenizer, report)
        traffic.take_references()
        missing = [k for k, v in traffic.references.items() if v is None or v == {}]
        if missing or None in traffic.references["probes"].values():
            print(f"FAIL: references not answered: {missing or traffic.references['probes']}")
            return 1
        elapsed = run_traffic(args, traffic)
        checks = post_checks(args, traffic, process)
    finally:
        process.terminate()
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
    sent = sum(traffic.counts.values())
    print(f"{sent} requests in {elapsed:.0f} s from {args.threads} threads")
    print("per kind: " + ", ".join(f"{k} {traffic.counts[k]}" for k in KINDS))
    print("post-checks: " + json.dumps(checks))
    for failure in traffic.failures:
        print(f"FAIL {failure}")
    print("PASS" if not traffic.failures else f"FAILED: {len(traffic.failures)} failures")
    return 0 if not traffic.failures else 1


if __name__ == "__main__":
    sys.exit(main())
