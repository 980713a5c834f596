"""Configuration from the environment; anything left unset falls back to embedded services."""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import BaseModel, Field

PROJECT_ROOT = Path(__file__).resolve().parent.parent

DEFAULT_TASK_QUEUE = "deadline-cleanup"
DEFAULT_NAMESPACE = "default"
EMBEDDED_TEMPORAL_PORT = 7233
EMBEDDED_UI_PORT = 8233


class Settings(BaseModel):
    """Where Temporal and Postgres are; `None` means "start the embedded one"."""

    temporal_address: str | None = None
    temporal_namespace: str = DEFAULT_NAMESPACE
    task_queue: str = DEFAULT_TASK_QUEUE
    database_url: str | None = None
    state_dir: Path = Field(default=PROJECT_ROOT / ".state")
    temporal_ui_url: str | None = None
    pool_max_size: int = Field(default=8, ge=1, le=200)
    max_concurrent_activities: int = Field(default=16, ge=1, le=1000)

    @classmethod
    def from_env(cls, **overrides: object) -> Settings:
        env = os.environ
        values: dict[str, object] = {
            "temporal_address": env.get("TEMPORAL_ADDRESS") or None,
            "temporal_namespace": env.get("TEMPORAL_NAMESPACE") or DEFAULT_NAMESPACE,
            "task_queue": env.get("TEMPORAL_TASK_QUEUE") or DEFAULT_TASK_QUEUE,
            "database_url": env.get("DATABASE_URL") or None,
            "temporal_ui_url": env.get("TEMPORAL_UI_URL") or None,
        }
        if env.get("CLEANUP_STATE_DIR"):
            values["state_dir"] = Path(env["CLEANUP_STATE_DIR"])
        if env.get("DB_POOL_MAX_SIZE"):
            values["pool_max_size"] = int(env["DB_POOL_MAX_SIZE"])
        if env.get("WORKER_MAX_CONCURRENT_ACTIVITIES"):
            values["max_concurrent_activities"] = int(env["WORKER_MAX_CONCURRENT_ACTIVITIES"])
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls.model_validate(values)

    def ui_url(self) -> str:
        if self.temporal_ui_url:
            return self.temporal_ui_url.rstrip("/")
        if self.temporal_address is None:
            return f"http://127.0.0.1:{EMBEDDED_UI_PORT}"
        host = self.temporal_address.rsplit(":", 1)[0]
        return f"http://{host}:8080"

    def workflow_url(self, workflow_id: str) -> str:
        return f"{self.ui_url()}/namespaces/{self.temporal_namespace}/workflows/{workflow_id}"
