"""Every path localchat reads or writes, in one place.

Platform directories come from platformdirs; ``LOCALCHAT_HOME`` overrides all of them so a
test or a user can isolate a whole run in one folder.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import platformdirs

APP_NAME = "localchat"
HOME_ENV = "LOCALCHAT_HOME"

EMBEDDINGS_FOLDER = "image-embeddings"  # in the states folder: its budget counts them


@dataclass(frozen=True)
class AppPaths:
    """The app's directories; nothing is created until a caller asks for it."""

    data_dir: Path
    config_dir: Path
    cache_dir: Path

    @property
    def demo_models_dir(self) -> Path:
        """Generated offline demo models, made once and reused."""
        return self.cache_dir / "demo-models"

    @property
    def speed_calibration(self) -> Path:
        """This machine's measured speed per weight type (``localchat hw --calibrate``)."""
        return self.cache_dir / "speed.json"

    @property
    def turn_speeds(self) -> Path:
        """Recent turns' speeds against the calibration's predictions (speed_feedback.py)."""
        return self.cache_dir / "turn-speeds.json"

    @property
    def database(self) -> Path:
        return self.data_dir / "conversations.sqlite3"

    @property
    def states_dir(self) -> Path:
        """Saved KV cache states, one file per (conversation, model)."""
        return self.data_dir / "states"

    @property
    def images_dir(self) -> Path:
        """Images put into messages, one file each under the SHA-256 of its bytes."""
        return self.data_dir / "images"

    @property
    def image_embeddings_dir(self) -> Path:
        """Images as a projector encoded them, a folder per projector: a state that holds an
        image is rebuilt from these, never by encoding it again. In the states folder: they
        count in its budget (``StateStore``), the oldest of either going first."""
        return self.states_dir / EMBEDDINGS_FOLDER

    @property
    def logs_dir(self) -> Path:
        """What helpers write as they run (an MCP server's stderr), one file each."""
        return self.data_dir / "logs"

    @property
    def user_catalog(self) -> Path:
        return self.config_dir / "models.toml"

    @property
    def settings_file(self) -> Path:
        return self.config_dir / "settings.toml"

    @property
    def local_models(self) -> Path:
        """GGUF files added by hand (``localchat add``)."""
        return self.data_dir / "local-models.json"

    @property
    def other_tools_home(self) -> Path:
        """Where other tools' model folders are looked for (LM Studio's, Ollama's): the
        user's home, or LOCALCHAT_HOME in an isolated run (which then sees only its own)."""
        isolated = os.environ.get(HOME_ENV)
        return Path(isolated).expanduser() if isolated else Path.home()

    @property
    def scan_dirs(self) -> Path:
        """Folders of GGUF files the user asked to be listed (``localchat models --scan``)."""
        return self.config_dir / "scan-dirs.json"

    @property
    def hub_cache(self) -> Path:
        """huggingface-hub's cache, shared with other tools (inside LOCALCHAT_HOME if set)."""
        if os.environ.get(HOME_ENV):
            return self.cache_dir / "hub"
        if os.environ.get("HF_HUB_CACHE"):
            return Path(os.environ["HF_HUB_CACHE"]).expanduser()
        hf_home = os.environ.get("HF_HOME") or os.path.join(
            os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "huggingface"
        )
        return Path(hf_home).expanduser() / "hub"


def app_paths() -> AppPaths:
    """Resolve the directories now (reads the environment on every call)."""
    home = os.environ.get(HOME_ENV)
    if home:
        root = Path(home).expanduser()
        return AppPaths(root / "data", root / "config", root / "cache")
    return AppPaths(
        Path(platformdirs.user_data_dir(APP_NAME)),
        Path(platformdirs.user_config_dir(APP_NAME)),
        Path(platformdirs.user_cache_dir(APP_NAME)),
    )


def ensure_private_dir(path: Path) -> Path:
    """Create ``path`` (and parents) readable by the user only."""
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    return path
