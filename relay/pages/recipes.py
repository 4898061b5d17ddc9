"""What the setup wizard tells a person to type: backend recipes and worker commands.

Plain data and string building, no Django: every command is quoted for the shell
it is shown for (POSIX ``sh`` on Linux and macOS, PowerShell on Windows), so
names and URLs typed into the wizard cannot break out of their argument. The worker
secret is always passed in the environment, never as a flag: a command line is
visible to every user of the GPU box (``ps``, ``/proc/<pid>/cmdline``).
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Callable
from dataclasses import dataclass, field

PLATFORMS: dict[str, str] = {"linux": "Linux", "macos": "macOS", "windows": "Windows"}
VENV = "modelrelay-worker"
PROMPT = "Say hello in five words."


@dataclass(frozen=True)
class Step:
    """One instruction: a sentence and, usually, a command to paste."""

    text: str
    command: str = ""


@dataclass(frozen=True)
class Backend:
    key: str
    label: str
    blurb: str
    backend_url: str
    #: A sensible ``--max-concurrent`` when the worker cannot ask the backend.
    max_concurrent: int | None
    steps: dict[str, tuple[Step, ...]] = field(default_factory=dict)
    note: str = ""

    def steps_for(self, platform: str) -> tuple[Step, ...]:
        return self.steps.get(platform) or self.steps["linux"]


def _check(url: str, platform: str) -> Step:
    tool = "curl.exe" if platform == "windows" else "curl"
    return Step("Check that it answers (it lists the loaded models):", f"{tool} {url}/v1/models")


def _llama() -> Backend:
    start = Step(
        "Start it with your model; -np 4 gives four parallel slots "
        "(the worker reads the slot count itself):",
        "llama-server -m model.gguf --port 8000 -np 4",
    )
    url = "http://127.0.0.1:8000"
    return Backend(
        key="llama",
        label="llama-server",
        blurb="llama.cpp's OpenAI-compatible server for GGUF models.",
        backend_url=url,
        max_concurrent=None,
        steps={
            "linux": (
                Step(
                    "Install llama.cpp: download a release for your GPU from "
                    "github.com/ggml-org/llama.cpp/releases, or build it from source."
                ),
                start,
                _check(url, "linux"),
            ),
            "macos": (
                Step("Install llama.cpp with Homebrew:", "brew install llama.cpp"),
                start,
                _check(url, "macos"),
            ),
            "windows": (
                Step("Install llama.cpp with winget (in PowerShell):", "winget install llama.cpp"),
                start,
                _check(url, "windows"),
            ),
        },
    )


def _ollama() -> Backend:
    url = "http://127.0.0.1:11434"
    pull = Step("Download a model:", "ollama pull llama3.2")
    return Backend(
        key="ollama",
        label="Ollama",
        blurb="Easy model management; serves an OpenAI API on port 11434.",
        backend_url=url,
        max_concurrent=None,
        note="Ollama serves its OpenAI-compatible API under /v1 on port 11434, so the "
        "worker's backend URL is http://127.0.0.1:11434. To run several requests at "
        "once, start Ollama with OLLAMA_NUM_PARALLEL=4 and give the worker "
        "--max-concurrent 4.",
        steps={
            "linux": (
                Step("Install Ollama:", "curl -fsSL https://ollama.com/install.sh | sh"),
                Step(
                    "Start the server (the installer may already run it as a service):",
                    "ollama serve",
                ),
                pull,
                _check(url, "linux"),
            ),
            "macos": (
                Step(
                    "Install Ollama with Homebrew (or the app from ollama.com):",
                    "brew install ollama",
                ),
                Step("Start the server:", "ollama serve"),
                pull,
                _check(url, "macos"),
            ),
            "windows": (
                Step(
                    "Install Ollama (its app starts the server in the background):",
                    "winget install Ollama.Ollama",
                ),
                Step("If it is not running yet, start it:", "ollama serve"),
                pull,
                _check(url, "windows"),
            ),
        },
    )


def _vllm() -> Backend:
    url = "http://127.0.0.1:8000"
    linux = (
        Step(
            "Install vLLM in its own virtual environment (Linux with an NVIDIA or AMD GPU):",
            "python3 -m venv vllm-env && vllm-env/bin/python -m pip install vllm",
        ),
        Step(
            "Serve a model (any Hugging Face model id):",
            "vllm-env/bin/vllm serve Qwen/Qwen2.5-7B-Instruct --port 8000",
        ),
        _check(url, "linux"),
    )
    return Backend(
        key="vllm",
        label="vLLM",
        blurb="High-throughput serving with continuous batching.",
        backend_url=url,
        max_concurrent=8,
        note="vLLM batches many requests at once; raise --max-concurrent to what your "
        "GPU sustains. On Windows, run vLLM inside WSL2 (Ubuntu) with the Linux "
        "commands; on macOS prefer llama-server or Ollama.",
        steps={"linux": linux},
    )


def _other() -> Backend:
    url = "http://127.0.0.1:8000"
    return Backend(
        key="other",
        label="Other",
        blurb="Any OpenAI-compatible server: LM Studio, SGLang, TGI, LocalAI…",
        backend_url=url,
        max_concurrent=None,
        note="Use the server's base URL without /v1 as the backend URL in the next "
        "step (LM Studio, for example, listens on http://127.0.0.1:1234).",
        steps={
            "linux": (
                Step("Start your server so that it serves the OpenAI API on this machine."),
                _check(url, "linux"),
            ),
            "windows": (
                Step("Start your server so that it serves the OpenAI API on this machine."),
                _check(url, "windows"),
            ),
        },
    )


BACKENDS: dict[str, Backend] = {b.key: b for b in (_llama(), _ollama(), _vllm(), _other())}


# --- worker commands ---------------------------------------------------------------------

_PS_SAFE = re.compile(r"^[A-Za-z0-9_./:=-]+$")


def ps_quote(value: str) -> str:
    """Quote one PowerShell argument (single quotes; a quote is doubled)."""
    if value and _PS_SAFE.match(value):
        return value
    return "'" + value.replace("'", "''") + "'"


@dataclass(frozen=True)
class WorkerSetup:
    """Everything that goes into one worker's command line and environment."""

    public_url: str
    provider: str
    secret: str
    backend_url: str
    models: tuple[str, ...] = ()
    max_concurrent: int | None = None

    @property
    def bundle_url(self) -> str:
        return f"{self.public_url}/setup/worker.pyz"

    def arguments(self) -> list[str]:
        """Flag, value, flag, value, … — everything but the secret."""
        args = ["--proxy-url", self.public_url, "--provider", self.provider]
        if self.backend_url:  # else the worker finds it on the box's usual ports
            args += ["--backend-url", self.backend_url]
        if self.models:
            args += ["--models", ",".join(self.models)]
        if self.max_concurrent:
            args += ["--max-concurrent", str(self.max_concurrent)]
        return args

    def environment(self) -> list[tuple[str, str]]:
        """The same settings as the worker's environment variables, the secret included."""
        env = [
            ("PROXY_URL", self.public_url),
            ("PROVIDER_NAME", self.provider),
            ("WORKER_SECRET", self.secret),
        ]
        if self.backend_url:
            env.append(("BACKEND_URL", self.backend_url))
        if self.models:
            env.append(("MODELS", ",".join(self.models)))
        if self.max_concurrent:
            env.append(("MAX_CONCURRENT", str(self.max_concurrent)))
        return env


@dataclass(frozen=True)
class WorkerCommand:
    """The install-and-run lines for one platform, and the run line on its own."""

    platform: str
    label: str
    shell: str
    install: tuple[str, ...]
    run: str

    @property
    def script(self) -> str:
        """All lines as one paste; POSIX stops at the first failing line."""
        lines = [*self.install, self.run]
        if self.shell == "sh":
            return " && \\\n".join(lines)
        return "\n".join(lines)


def worker_command(platform: str, setup: WorkerSetup, requirements: list[str]) -> WorkerCommand:
    q: Callable[[str], str]
    if platform == "windows":
        python = rf".\{VENV}\Scripts\python.exe"
        q = ps_quote
        install = (
            f"py -m venv {VENV}",
            f"{python} -m pip install " + " ".join(q(r) for r in requirements),
            f"Invoke-WebRequest -UseBasicParsing -OutFile worker.pyz {q(setup.bundle_url)}",
        )
        shell = "powershell"
    else:
        python = f"{VENV}/bin/python"
        q = shlex.quote
        install = (
            f"python3 -m venv {VENV}",
            f"{python} -m pip install " + " ".join(q(r) for r in requirements),
            f"curl -fsSLO {q(setup.bundle_url)}",
        )
        shell = "sh"
    args = setup.arguments()
    pairs = [f"{q(args[i])} {q(args[i + 1])}" for i in range(0, len(args), 2)]
    if shell == "sh":  # one flag per line: long URLs stay readable
        # The secret only in the worker's environment, for this one command.
        run = " \\\n  ".join([f"WORKER_SECRET={q(setup.secret)}", f"{python} worker.pyz", *pairs])
    else:  # PowerShell's backtick continuation breaks on a trailing space: one line
        # An assignment takes an expression: the value is always quoted there.
        secret = "'" + setup.secret.replace("'", "''") + "'"
        run = " ".join([f"$env:WORKER_SECRET = {secret};", f"{python} worker.pyz", *pairs])
    return WorkerCommand(platform, PLATFORMS[platform], shell, install, run)


_ENV_SAFE = re.compile(r"^[A-Za-z0-9_./:,@+=-]*$")


def env_file(setup: WorkerSetup) -> str:
    """The worker's settings as a systemd ``EnvironmentFile`` (deploy/worker.env.example).

    Values that are not plainly safe are double-quoted with systemd's escapes.
    """
    lines = []
    for name, value in setup.environment():
        if not _ENV_SAFE.match(value):
            escaped = "".join("\\" + c if c in '"\\`$' else c for c in value)
            value = f'"{escaped}"'
        lines.append(f"{name}={value}")
    return "\n".join(lines) + "\n"


def curl_test(public_url: str, model: str, *, api_key: bool = False) -> str:
    """A ready-to-paste chat completion request through the relay (POSIX shell)."""
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": PROMPT}]})
    lines = [f"curl {shlex.quote(public_url + '/v1/chat/completions')}"]
    if api_key:
        lines.append('-H "Authorization: Bearer $MODELRELAY_API_KEY"')
    lines += ['-H "Content-Type: application/json"', f"-d {shlex.quote(body)}"]
    return " \\\n  ".join(lines)


def powershell_test(public_url: str, model: str, *, api_key: bool = False) -> str:
    """The same request for Windows PowerShell, where curl's quoting differs."""
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": PROMPT}]})
    parts = [
        "Invoke-RestMethod -Method Post",
        f"-Uri {ps_quote(public_url + '/v1/chat/completions')}",
        "-ContentType 'application/json'",
    ]
    if api_key:
        parts.append('-Headers @{Authorization = "Bearer $env:MODELRELAY_API_KEY"}')
    parts.append(f"-Body {ps_quote(body)}")
    return " ".join(parts)


# --- joining with a token (SPEC §22) -----------------------------------------------------


@dataclass(frozen=True)
class JoinSetup:
    """What a box that joins with a token is told: two commands, no shared secret."""

    public_url: str
    token: str
    wheel: str  # the wheel's file name, served at /setup/<wheel>
    backend_url: str = ""  # empty: the worker finds the backend itself
    models: tuple[str, ...] = ()
    max_concurrent: int | None = None

    @property
    def wheel_url(self) -> str:
        return f"{self.public_url}/setup/{self.wheel}"

    def arguments(self) -> list[str]:
        """Flag, value, flag, value, …: the relay and the token, then what was asked for."""
        args = ["--proxy-url", self.public_url, "--join-token", self.token]
        if self.backend_url:
            args += ["--backend-url", self.backend_url]
        if self.models:
            args += ["--models", ",".join(self.models)]
        if self.max_concurrent:
            args += ["--max-concurrent", str(self.max_concurrent)]
        return args


def join_commands(platform: str, setup: JoinSetup) -> WorkerCommand:
    """The two commands for a box that joins: install the worker's package from this
    relay into a virtual environment, then run it once with the join token (it keeps
    the credential it gets for that token; the same command runs it again later)."""
    q: Callable[[str], str]
    if platform == "windows":
        q = ps_quote
        folder = rf".\{VENV}\Scripts"
        install = (
            f"py -m venv {VENV}",
            rf"{folder}\python.exe -m pip install {q(setup.wheel_url)}",
        )
        program = rf"{folder}\modelrelay-worker.exe"
        shell = "powershell"
    else:
        q = shlex.quote
        install = (f"python3 -m venv {VENV}", f"{VENV}/bin/pip install {q(setup.wheel_url)}")
        program = f"{VENV}/bin/modelrelay-worker"
        shell = "sh"
    args = setup.arguments()
    run = " ".join([program, *(q(arg) for arg in args)])
    return WorkerCommand(platform, PLATFORMS[platform], shell, install, run)


def install_line(command: WorkerCommand) -> str:
    """The install lines as one paste: ``&&`` in sh, one per line in PowerShell (5.1 has
    no ``&&``)."""
    return (" && " if command.shell == "sh" else "\n").join(command.install)
