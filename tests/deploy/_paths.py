"""Where the deployment material lives, for the tests of ``deploy/``."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
SYSTEMD = DEPLOY / "systemd"
CONTAINER = DEPLOY / "container"
KUBERNETES = DEPLOY / "kubernetes"
RABBITMQ = DEPLOY / "rabbitmq"
SERVICEBUS = DEPLOY / "servicebus"
CLOUD_INIT = DEPLOY / "cloud-init"
FIXTURES = Path(__file__).resolve().parent / "fixtures"
