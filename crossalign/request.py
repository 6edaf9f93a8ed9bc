"""A run request: every parameter of an alignment run, validated once and resolved once.

``crossalign run`` and ``crossalign rerun`` build a :class:`RunRequest` from their options, the
alignment flow from its run form's fields (the same names, documented in the form: the flow's
docstring), the rerun and nightly flows from theirs. :meth:`RunRequest.resolve` is the one place a
run's config is parsed: it loads the config with its overrides, names the run and settles its store
and where step 1's weights come from; the run store freezes that config into run.json
(``crossalign.tasks.prepare.prepare_run``).

A caller that resolved a request itself (the CLI, to refuse bad input before Prefect starts; the
nightly flow, to name its runs after their models) calls the alignment flow inside
:func:`handing_over`; the flow takes that resolution (:func:`resolution`) instead of parsing again.
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Iterator, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from crossalign.config import AlignmentConfig, ConfigError, OverrideError, load_config, resolve_config_path
from crossalign.dag import StepName
from crossalign.data.files import DatasetFiles
from crossalign.site import load_site
from crossalign.store import RunStore, StoreError, check_run_id, new_run_id, sha256_file

Mode = Literal["distributed", "embedded"]


class RequestError(ConfigError):
    """A request whose fields do not make a run; the message names the field as the run form does."""


def as_typed(items: list[str] | None) -> list[str]:
    """A list parameter as the user meant it: each item stripped of blanks and of the quotes the UI's list field
    takes literally (a form item typed as "training.train_iters=10" keeps its quotes), empty items dropped."""
    cleaned = []
    for item in items or []:
        item = item.strip()
        if len(item) >= 2 and item[0] == item[-1] and item[0] in "\"'":
            item = item[1:-1].strip()
        if item:
            cleaned.append(item)
    return cleaned


def form_error(exc: Exception) -> str:
    """A refused request in the words of the run form (its fields: config, overrides, from_hf), not the command
    line's (--set, --from-hf), which the config and the store speak."""
    text = str(exc).replace(" with --set ", " with overrides ").replace("--from-hf ", "from_hf ")
    if isinstance(exc, OverrideError) and text.startswith("--set "):
        text = "overrides: " + text.removeprefix("--set ")
    return text


def hf_start(directory: Path) -> dict[str, Any]:
    """The start record of a run whose step 1 imports a Hugging Face checkpoint (its folder and config.json digest)."""
    config_json = Path(directory).absolute() / "config.json"
    if not config_json.is_file():
        raise StoreError(f"--from-hf {directory}: no config.json there; not a Hugging Face checkpoint folder")
    return {"from": "huggingface", "path": str(config_json.parent), "config_sha256": sha256_file(config_json)}


class RunRequest(BaseModel):
    """Every parameter of an alignment run. The fields are the alignment flow's run form, which documents them
    (``crossalign.flows.alignment.alignment``); a request that does not make a run raises :class:`RequestError`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    config: str | None = "qwen35_dense_tiny"
    run_id: str | None = None
    overrides: list[str] = []
    store: str | None = None
    rerun: list[StepName] = []  # type: ignore[valid-type]
    mode: Mode = "distributed"
    dataset_prefix: str | None = None
    tokenizer: str | None = None
    retries: int = Field(2, ge=0)
    retry_delay_s: float = Field(10.0, ge=0)
    step_timeout_s: float | None = Field(None, gt=0)
    poll_interval_s: float = Field(0.5, gt=0)
    from_hf: str | None = None
    fail_fast: bool = True

    def __init__(self, **fields: Any) -> None:
        try:
            super().__init__(**fields)
        except ValidationError as exc:
            raise RequestError("; ".join(_field_error(error) for error in exc.errors())) from None

    @field_validator("config", "run_id", "store", "dataset_prefix", "tokenizer", "from_hf", mode="before")
    @classmethod
    def _blank_is_none(cls, value: Any) -> Any:
        return (value.strip() or None) if isinstance(value, str) else value

    @field_validator("overrides", "rerun", mode="before")
    @classmethod
    def _items(cls, value: Any) -> Any:
        return as_typed(value) if value is None or isinstance(value, (list, tuple)) else value

    @model_validator(mode="after")
    def _whole(self) -> "RunRequest":
        if self.config is None and self.run_id is None:
            raise ValueError("config: give a config, or the run_id of an existing run to reopen")
        if (self.dataset_prefix is None) != (self.tokenizer is None):
            raise ValueError("dataset_prefix and tokenizer go together: give both or neither")
        return self

    def form(self) -> dict[str, Any]:
        """The request as the alignment flow's parameters (its run form's fields)."""
        return self.model_dump(mode="json")

    def resolve(self) -> "ResolvedRequest":
        """The run as it will be carried out: the config loaded with the overrides (None: reopen the run as it is),
        the run id (a new one from the model's name when none was given), the store (the site's when none was
        given) and where step 1's weights come from. Raises ConfigError for the config or an override, StoreError
        for the run id or the Hugging Face folder."""
        config = None if self.config is None else load_config(self.config, self.overrides)
        run_id = check_run_id(self.run_id or new_run_id(config.model.name))
        store = RunStore(self.store or load_site().store)
        start = None if self.from_hf is None else hf_start(Path(self.from_hf))
        return ResolvedRequest(self.model_copy(update={"run_id": run_id, "store": str(store.root)}), config,
                               None if self.config is None else resolve_config_path(self.config), start)


def _field_error(error: Any) -> str:
    message = error["msg"].removeprefix("Value error, ")
    location = ".".join(str(part) for part in error["loc"])
    return f"{location}: {message}" if location else message


@dataclass(frozen=True)
class ResolvedRequest:
    """A request as its run will be carried out: ``request`` with its run id and store set, its ``config`` loaded
    from ``config_source`` (None for both: the run is reopened as it is), and its ``start`` (None: as the run
    records it, or base training for a new run)."""

    request: RunRequest
    config: AlignmentConfig | None
    config_source: Path | None
    start: dict[str, Any] | None

    @property
    def run_id(self) -> str:
        return self.request.run_id

    @property
    def store(self) -> RunStore:
        return RunStore(self.request.store)

    @property
    def dataset(self) -> DatasetFiles | None:
        request = self.request
        return None if request.dataset_prefix is None else DatasetFiles(Path(request.dataset_prefix),
                                                                         Path(request.tokenizer))

    def named(self, run_id: str) -> "ResolvedRequest":
        """The same request under another run id."""
        return replace(self, request=self.request.model_copy(update={"run_id": check_run_id(run_id)}))

    def check_store(self) -> None:
        """Refuse now, before anything starts, a run id whose run exists with another config."""
        if self.config is not None and self.store.exists(self.run_id):
            self.store.run(self.run_id).check_config(self.config)


_handed_over: ContextVar[ResolvedRequest | None] = ContextVar("crossalign_resolved_request", default=None)


@contextmanager
def handing_over(resolved: ResolvedRequest) -> Iterator[None]:
    """Let an alignment flow called in this context take ``resolved`` as the resolution of its request."""
    token = _handed_over.set(resolved)
    try:
        yield
    finally:
        _handed_over.reset(token)


def resolution(request: RunRequest) -> ResolvedRequest:
    """``request`` resolved: the resolution its caller handed over for it (:func:`handing_over`), else resolved now."""
    handed = _handed_over.get()
    return handed if handed is not None and handed.request == request else request.resolve()
