"""llama.cpp's own test material, from the llama-cpp-python sdist on PyPI, fetched once into a
cache: the tokenizer test vocabularies (`models/ggml-vocab-*.gguf` with their `.inp`/`.out`
cases), the real chat templates llama.cpp tests against (`models/templates/*.jinja`) and
`src/llama-vocab.cpp` (its table of pre-tokenizers).

The sdist (76 MB) is looked for in `<cache>/downloads/`, downloaded there with pip when absent,
and checked against its pinned sha256 either way; only the files above are extracted (tarfile's
'data' filter, nothing outside the target folder), into `<cache>/llama-cpp-0.3.36/`. The cache is
`$ANE_SPEC_CACHE`, or `~/.cache/ane-spec`.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path, PurePosixPath

VERSION = "0.3.36"
SDIST = f"llama_cpp_python-{VERSION}.tar.gz"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
ROOT = f"llama_cpp_python-{VERSION}/vendor/llama.cpp/"
# (folder inside llama.cpp, file-name prefix, file-name suffix) of what is extracted.
WANTED = (("models", "ggml-vocab-", ""), ("models/templates", "", ".jinja"),
          ("src", "llama-vocab.cpp", ""))
DONE = ".complete"


def cache_dir() -> Path:
    env = os.environ.get("ANE_SPEC_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "ane-spec"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def sdist(downloads: Path) -> Path:
    """The checked sdist in `downloads`, fetched from PyPI (no dependencies, no build) if absent."""
    path = downloads / SDIST
    if not path.exists():
        # Into a folder of this process's own, then renamed: parallel test workers may both
        # download, and neither may read the other's half-written file.
        work = downloads / f".download.{os.getpid()}"
        work.mkdir(parents=True, exist_ok=True)
        try:
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary",
                            "llama-cpp-python", f"llama-cpp-python=={VERSION}", "-d", str(work)],
                           check=True, stdout=subprocess.DEVNULL)
            os.replace(work / SDIST, path)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    digest = _sha256(path)
    if digest != SDIST_SHA256:
        raise RuntimeError(f"{path}: sha256 {digest}, expected {SDIST_SHA256}; delete it to "
                           "download it again")
    return path


def _wanted(name: str) -> str | None:
    """The path under llama.cpp/ of a member to extract, or None."""
    if not name.startswith(ROOT):
        return None
    rel = PurePosixPath(name[len(ROOT):])
    if ".." in rel.parts or rel.is_absolute():
        return None
    folder, file = str(rel.parent), rel.name
    for want_folder, prefix, suffix in WANTED:
        if folder == want_folder and file.startswith(prefix) and file.endswith(suffix):
            return str(rel)
    return None


def llama_cpp_tree(cache: Path | None = None) -> Path:
    """The extracted folder (`models/`, `models/templates/`, `src/`), made once."""
    cache = cache or cache_dir()
    target = cache / f"llama-cpp-{VERSION}"
    if (target / DONE).exists():
        return target
    archive = sdist(cache / "downloads")
    tmp = cache / f".llama-cpp-{VERSION}.{os.getpid()}"
    tmp.mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive, "r:gz") as tar:
        members = []
        for m in tar.getmembers():
            rel = _wanted(m.name)
            if rel is not None and m.isfile():
                m.name = rel
                members.append(m)
        tar.extractall(tmp, members=members, filter="data")
    (tmp / DONE).write_text(SDIST_SHA256 + "\n")
    try:
        tmp.rename(target)
    except OSError:  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
        if not (target / DONE).exists():
            raise
    return target


def read_cases(inp: Path, out: Path) -> dict[str, list[int]]:
    """A vocabulary's test cases as test-tokenizer-0.cpp reads them: inputs separated by
    "\\n__ggml_vocab_test__\\n", one line of ids per input; a repeated input keeps its last
    expected ids (a std::map)."""
    raw = inp.read_bytes().decode("utf-8")
    lines = out.read_bytes().decode("utf-8").split("\n")
    if lines and lines[-1] == "":
        lines.pop()  # std::getline yields no line after the final newline
    sep = "\n__ggml_vocab_test__\n"
    texts: list[str] = []
    pos = 0
    while pos < len(raw):
        nxt = raw.find(sep, pos)
        if nxt < 0:
            texts.append(raw[pos:])
            break
        texts.append(raw[pos:nxt])
        pos = nxt + len(sep)
    if len(texts) != len(lines):
        raise ValueError(f"{inp.name}: {len(texts)} inputs but {len(lines)} outputs")
    # string_strip trims whitespace; ids are separated by single spaces.
    return {t: [int(x) for x in line.strip().split(" ") if x] for t, line in zip(texts, lines)}


# -- llama.cpp's pre-tokenizer table, read from src/llama-vocab.cpp --------------------------

_C_ESCAPES = {"\\": "\\", '"': '"', "r": "\r", "n": "\n", "t": "\t", "'": "'"}


def _strip_comments_and_strings(src: str) -> tuple[str, list[str]]:
    """`src` without // and /* */ comments, each string literal replaced by `"#<k>"`, and the
    literals (C escapes decoded; adjacent literals are not joined, none of the tables uses it)."""
    out: list[str] = []
    literals: list[str] = []
    i, n = 0, len(src)
    while i < n:
        if src.startswith("//", i):
            i = src.find("\n", i)
            i = n if i < 0 else i
        elif src.startswith("/*", i):
            i = src.index("*/", i) + 2
        elif src[i] == '"':
            j = i + 1
            buf: list[str] = []
            while src[j] != '"':
                if src[j] == "\\" and src[j + 1] in _C_ESCAPES:
                    buf.append(_C_ESCAPES[src[j + 1]])
                    j += 2
                elif src[j] == "\\" and src[j + 1] == "x":  # \xHH..
                    k = j + 2
                    while src[k] in "0123456789abcdefABCDEF":
                        k += 1
                    buf.append(chr(int(src[j + 2:k], 16)))
                    j = k
                elif src[j] == "\\":  # \0, \a, ...: not in the tables read here
                    buf.append(src[j + 1])
                    j += 2
                else:
                    buf.append(src[j])
                    j += 1
            out.append(f'"#{len(literals)}"')
            literals.append("".join(buf))
            i = j + 1
        elif src[i] == "'" and src[i + 2:i + 3] == "'":  # a char literal such as '"'
            out.append(src[i:i + 3])
            i += 3
        elif src[i] == "'" and src[i + 1] == "\\":
            j = src.index("'", i + 3)
            out.append(src[i:j + 1])
            i = j + 1
        else:
            out.append(src[i])
            i += 1
    return "".join(out), literals


def llama_cpp_pre_table(vocab_cpp: Path) -> tuple[dict[str, dict], dict[str, dict]]:
    """(names, types) as llama-vocab.cpp has them for BPE vocabularies:
    names[name] = {"type": TYPE, "flags": {flag: value set in its branch}};
    types[TYPE] = {"exprs": (...), "byte_encode": bool} from llm_tokenizer_bpe's constructor."""
    import re

    code, lits = _strip_comments_and_strings(vocab_cpp.read_text(encoding="utf-8"))

    def lit(token: str) -> str:
        return lits[int(token[2:-1])]

    # Names: the if/else-if chain under `if (type == LLAMA_VOCAB_TYPE_BPE)`.
    start = code.index("if (type == LLAMA_VOCAB_TYPE_BPE) {")
    end = code.index("} else if (type == LLAMA_VOCAB_TYPE_SPM)", start)
    names: dict[str, dict] = {}
    for branch in code[start:end].split("} else if (")[1:]:
        found = re.findall(r'tokenizer_pre == ("#\d+")', branch)
        kind = re.search(r"pre_type = LLAMA_VOCAB_PRE_TYPE_(\w+);", branch)
        if not found or not kind:
            continue
        flags = dict(re.findall(r"\b(ignore_merges|add_bos|clean_spaces|add_sep|"
                                r"escape_whitespaces|special_bos_id) = (\w+);", branch))
        for token in found:
            names[lit(token)] = {"type": kind.group(1), "flags": flags}

    # Expressions: the switch in llm_tokenizer_bpe(const llama_vocab & vocab).
    start = code.index("llm_tokenizer_bpe(const llama_vocab & vocab) {")
    end = code.index("std::vector<std::string> regex_exprs;", start)
    types: dict[str, dict] = {}
    pending: list[str] = []
    for m in re.finditer(r"case LLAMA_VOCAB_PRE_TYPE_(\w+):|default:|regex_exprs = \{(.*?)\};"
                         r"|byte_encode = false;|break;", code[start:end], re.S):
        text = m.group(0)
        if text.startswith(("case", "default")):
            pending.append(m.group(1) or "DEFAULT")
        elif text.startswith("regex_exprs"):
            exprs = tuple(lit(t) for t in re.findall(r'"#\d+"', m.group(2)))
            for t in pending:
                types[t] = {"exprs": exprs, "byte_encode": True}
        elif text.startswith("byte_encode"):
            for t in pending:
                types[t]["byte_encode"] = False
        else:
            pending = []
    return names, types
