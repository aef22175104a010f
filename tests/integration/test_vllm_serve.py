"""The command `peagle demo` prints works: vLLM's OpenAI-compatible server, started with exactly that
`--speculative-config`, answers a chat completion with the verifier's own greedy answer."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from peagle_core.processes import stop_process
from peagle_core.serving.export import serve_command
from tests.fixtures.servers import free_port, wait_until_healthy
from tests.fixtures.vllm import SERVING_NEW_TOKENS


def _printed_args(command: str) -> list[str]:
    """The server arguments of the printed command (everything after the environment and program)."""
    words = shlex.split(command)
    assert words[0] == "VLLM_USE_V2_MODEL_RUNNER=0"
    assert words[1:4] == ["python", "-m", "vllm.entrypoints.openai.api_server"]
    return words[4:]


@pytest.fixture(scope="module")
def vllm_server(exported_drafters, toy_verifier_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    drafter = exported_drafters["draft-vocab-1-layer"]
    command = serve_command(str(toy_verifier_dir), drafter, 3, as_module=True)
    port = free_port()
    log = tmp_path_factory.mktemp("vllm-serve") / "server.log"
    env = {**os.environ, "VLLM_USE_V2_MODEL_RUNNER": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
    # The printed command, plus what this 2-core CPU needs: a port, fp32 and a short context.
    args = [*_printed_args(command), "--port", str(port), "--dtype", "float32", "--max-model-len", "512"]
    args += ["--enforce-eager"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *args],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(f"{url}/health", proc, log, timeout_s=600)
        yield url, command
    finally:
        stop_process(proc, grace_s=60)


def test_the_printed_serve_command_answers_with_the_verifier_greedy_answer(
    vllm_server, toy_verifier_dir: Path, serving_conversations, plain_greedy
) -> None:
    from openai import OpenAI
    from transformers import AutoTokenizer

    url, command = vllm_server
    assert "--speculative-config" in command and '"parallel_drafting": true' in command
    tok = AutoTokenizer.from_pretrained(str(toy_verifier_dir))
    client = OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=120)
    for messages, reference in list(zip(serving_conversations, plain_greedy, strict=True))[:3]:
        reply = client.chat.completions.create(
            model=str(toy_verifier_dir),
            messages=messages,
            temperature=0.0,
            max_tokens=SERVING_NEW_TOKENS,
        )
        expected = tok.decode(reference, skip_special_tokens=True)
        assert reply.choices[0].message.content == expected, json.dumps(messages)
    metrics = httpx.get(f"{url}/metrics", timeout=10).text
    drafts = [line for line in metrics.splitlines() if line.startswith("vllm:spec_decode_num_drafts")]
    assert drafts and float(drafts[0].split()[-1]) > 0  # the server drafted with our checkpoint
