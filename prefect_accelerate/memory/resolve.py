"""Find a model's description: a local folder, the Hugging Face cache, a timm architecture, or the Hub.

Offline first. Accelerate always asks the Hub (`model_info`) before anything else, so it cannot size a
local folder and reports every failure, a missing repo included, as "gated" (reference §5, §13.13).
We look in this order and only ask the Hub when nothing local matches:

1. a folder (or its ``config.json``) on disk;
2. a repo id whose ``config.json`` is in the local Hugging Face cache (works with HF_HUB_OFFLINE=1);
   the library is read from the config itself;
3. a timm architecture name (``resnet50``, ``vit_base_patch16_224.augreg_in21k``);
4. the Hub: library from the model's metadata, then only ``config.json`` is downloaded.

Nothing here imports torch; timm is imported only for step 3, transformers never.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

from prefect_accelerate.errors import DependencyError, EstimateError, did_you_mean, failed_import
from prefect_accelerate.memory.models import ModelSource

CONFIG_NAME = "config.json"
_REPO_ID_RE = re.compile(r"^[A-Za-z0-9][\w.\-]*(/[\w.\-]+)?$")


def resolve_model(name: str, library_name: str | None = None) -> ModelSource:
    """Turn what the user typed into a `ModelSource`, without importing torch or downloading weights.

    Args:
        name: a folder, a path to a ``config.json``, a Hub repo id, or a timm architecture name.
        library_name: ``transformers`` or ``timm`` when the user says so; otherwise read from the config.

    Raises:
        EstimateError: nothing matches, the config is missing or broken, or the Hub refuses (gated,
            missing repo, no library metadata), each with its own message.
    """
    path = Path(name).expanduser()
    if path.is_file() and path.name == CONFIG_NAME:
        path = path.parent
    if path.is_dir():
        return _local_source(name, path, library_name)
    if _looks_like_path(name):
        raise EstimateError(
            f"`{name}` looks like a path, but there is no folder there (looked at {path.resolve()}). "
            "Give the folder that holds the model's config.json, a Hub repo id such as `org/model`, or a timm "
            "architecture name such as `resnet50`."
        )
    if not _REPO_ID_RE.match(name):
        raise EstimateError(
            f"`{name}` is neither an existing folder nor a valid Hub repo id (`name` or `org/name`, letters, "
            "digits, `-`, `_` and `.`) nor a timm architecture name. Check the spelling, or give the folder "
            "that holds the model's config.json."
        )
    cached = _cached_config(name)
    if cached is not None:
        config, raw = _read_config(cached, f"the Hugging Face cache entry for `{name}`")
        library = library_name or _library_from_config(config, name, cached)
        return ModelSource(name=name, kind="hf-cache", library=library, location=str(cached.parent),
                           config_sha256=_sha256(raw), config=config)
    timm_source = _timm_source(name, library_name)
    if timm_source is not None:
        return timm_source
    return _hub_source(name, library_name)


def _local_source(name: str, folder: Path, library_name: str | None) -> ModelSource:
    config_file = folder / CONFIG_NAME
    if not config_file.is_file():
        raise EstimateError(
            f"The folder {folder} has no {CONFIG_NAME}, so there is no model description to size. "
            "Point at the folder written by `save_pretrained` (transformers) or `push_to_hub`/`save_for_hf` "
            "(timm), which holds config.json; weights are not needed."
        )
    config, raw = _read_config(config_file, f"the folder {folder}")
    library = library_name or _library_from_config(config, name, config_file)
    digest = hashlib.sha256(raw)
    if config.get("auto_map"):
        # remote code changes the model as much as the config does
        for source in sorted(folder.glob("*.py")):
            digest.update(source.name.encode())
            digest.update(source.read_bytes())
    return ModelSource(name=name, kind="local", library=library, location=str(folder.resolve()),
                       config_sha256=digest.hexdigest(), config=config)


def _read_config(config_file: Path, where: str) -> tuple[dict[str, Any], bytes]:
    raw = config_file.read_bytes()
    try:
        config = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise EstimateError(
            f"{config_file} (from {where}) is not valid JSON: {error}. Fix the file, or write it again with "
            "`config.save_pretrained(folder)`."
        ) from None
    if not isinstance(config, dict):
        raise EstimateError(
            f"{config_file} (from {where}) holds a JSON {type(config).__name__}, not an object with the "
            "model's settings. Write it again with `config.save_pretrained(folder)`."
        )
    return config, raw


def _library_from_config(config: dict[str, Any], name: str, config_file: Path) -> str:
    if "model_type" in config or "architectures" in config or "auto_map" in config:
        return "transformers"
    if "architecture" in config:
        return "timm"
    raise EstimateError(
        f"{config_file} (for `{name}`) has neither `model_type`/`architectures` (transformers) nor "
        "`architecture` (timm), so the library is unknown. Pass `--library_name transformers` or "
        "`--library_name timm`."
    )


def _looks_like_path(name: str) -> bool:
    return name.startswith((".", "/", "~")) or name.count("/") > 1 or os.sep != "/" and os.sep in name


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def hub_offline() -> bool:
    """True when HF_HUB_OFFLINE is set (read at call time, as huggingface_hub does)."""
    try:
        from huggingface_hub import constants

        return bool(constants.is_offline_mode()) if hasattr(constants, "is_offline_mode") else bool(constants.HF_HUB_OFFLINE)
    except ImportError:
        return os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")


def _cached_config(repo_id: str) -> Path | None:
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    try:
        found = try_to_load_from_cache(repo_id, CONFIG_NAME)
    except Exception:  # an id huggingface_hub rejects is simply not in the cache
        return None
    return Path(found) if isinstance(found, str) else None


def _timm_source(name: str, library_name: str | None) -> ModelSource | None:
    if library_name == "transformers" or "/" in name:
        return None
    try:
        import timm
    except ImportError:
        if library_name == "timm":
            raise DependencyError.missing("timm", "timm", f"Sizing the timm model `{name}`") from None
        return None
    except Exception:  # installed but broken: only an error when timm was asked for (the caller reports it)
        if library_name == "timm":
            raise
        return None
    if timm.is_model(name):
        from importlib.metadata import version

        arch = name
        return ModelSource(name=name, kind="timm", library="timm", location=arch,
                           config_sha256=_sha256(f"timm:{arch}:{version('timm')}".encode()))
    if library_name == "timm":
        raise EstimateError(
            f"`{name}` is not a timm architecture (timm {timm.__version__} knows {len(timm.list_models())} "
            f"names).{did_you_mean(name.split('.')[0], timm.list_models())} See `timm.list_models('{name[:4]}*')`, "
            "or give a Hub repo id such as `timm/resnet50.a1_in1k`."
        )
    return None


def _timm_import_problem() -> str | None:
    """Why timm names could not be checked, when timm is installed but fails to import; None otherwise."""
    try:
        import timm  # noqa: F401
    except ImportError:
        return None  # not installed: nothing to check, nothing to report
    except Exception as error:
        found = failed_import(error)
        module, cause = found if found else ("timm", error)
        return f"timm names could not be checked (timm is installed, but importing `{module}` fails: {type(cause).__name__}: {cause})"
    return None


def _timm_hint(name: str) -> str:
    """For a bare name that is neither a repo nor a timm architecture: the closest timm name, if any."""
    if "/" in name:
        return ""
    problem = _timm_import_problem()
    if problem:
        return f" {problem}."
    try:
        import timm
    except ImportError:
        return ""
    hint = did_you_mean(name.split(".")[0], timm.list_models())
    return f" It is not a timm architecture either.{hint}" if hint else ""


def _hub_source(name: str, library_name: str | None) -> ModelSource:
    try:
        from huggingface_hub import constants
    except ImportError:  # offline or not, a Hub id is looked up through huggingface_hub
        raise DependencyError.missing("huggingface_hub", "transformers", f"Looking up `{name}` on the Hub") from None
    if hub_offline():

        not_timm = (_timm_import_problem() if "/" not in name else None) or "it is not a timm architecture name"
        raise EstimateError(
            f"`{name}` is not a folder, its config.json is not in the Hugging Face cache ({constants.HF_HUB_CACHE}), "
            f"{not_timm}, and HF_HUB_OFFLINE=1 stops us asking the Hub. Download the "
            f"config once with `hf download {name} config.json` while online, point at a local folder, or unset "
            "HF_HUB_OFFLINE."
        )
    try:
        import huggingface_hub
        from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError
    except ImportError:
        raise DependencyError.missing("huggingface_hub", "transformers", f"Looking up `{name}` on the Hub") from None
    try:
        info = huggingface_hub.model_info(name)
    except GatedRepoError:
        raise EstimateError(
            f"The Hub repo `{name}` is gated: you must be logged in and have accepted its terms to read even its "
            "config. Accept them on the model page, log in with `hf auth login` (or set HF_TOKEN), and run again."
        ) from None
    except RepositoryNotFoundError:
        raise EstimateError(
            f"The Hub has no model repo `{name}` (or it is private and you are not logged in). Check the spelling "
            f"on the Hub; for a private repo log in with `hf auth login` or set HF_TOKEN.{_timm_hint(name)}"
        ) from None
    except (OSError, ValueError) as error:
        raise EstimateError(
            f"Could not ask the Hugging Face Hub about `{name}`: {error}. Check the network (or HF_ENDPOINT), "
            "or give a local folder holding the model's config.json."
        ) from None
    library = library_name or getattr(info, "library_name", None)
    if not library:
        raise EstimateError(
            f"The Hub repo `{name}` has no library metadata, so we cannot tell how to build it. Pass "
            "`--library_name transformers` or `--library_name timm`."
        )
    if library not in ("transformers", "timm"):
        raise EstimateError(
            f"The Hub repo `{name}` is a `{library}` model; estimate-memory sizes transformers and timm models "
            "only. If it loads with transformers anyway, pass `--library_name transformers`."
        )
    try:
        config_file = Path(huggingface_hub.hf_hub_download(name, CONFIG_NAME))
    except Exception as error:
        raise EstimateError(
            f"The Hub repo `{name}` ({library}) has no usable {CONFIG_NAME}: {error}. A model to size needs one; "
            "check that this is a model repo, or give a local folder."
        ) from None
    config, raw = _read_config(config_file, f"the Hub repo `{name}`")
    return ModelSource(name=name, kind="hub", library=library, location=str(config_file.parent),
                       config_sha256=_sha256(raw), config=config)
