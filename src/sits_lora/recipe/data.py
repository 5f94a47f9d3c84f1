"""Offline text data: the Python standard library's documentation as a corpus, and local files.

Every machine with Python has the standard library's docstrings, so the recipe, the tests and the
evaluations train on them without a hub. The corpus is one document per module (the module's
docstring, then each public class, function and method with its signature and docstring). The
held-out split is a fixed set of whole modules (by a hash of the name), so no held-out text is
seen in training. Docstrings differ slightly between Python versions: the cache file name carries
the version, and results should be compared within one Python version.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import json
import os
import re
import sys
import warnings
from pathlib import Path
from typing import Iterable, Optional

from ..utils.cache import cache_root

# Pure-Python documentation-rich modules present on every CPython >= 3.10 build. Sorted and fixed so
# the corpus is the same on every machine of one Python version.
STDLIB_MODULES = sorted(
    """
    abc argparse array ast asyncio base64 bisect bz2 calendar cmath codecs collections
    collections.abc colorsys concurrent.futures configparser contextlib contextvars copy copyreg
    csv dataclasses datetime decimal difflib dis email email.message email.parser enum errno
    filecmp fileinput fnmatch fractions ftplib functools gc getopt gettext glob graphlib gzip
    hashlib heapq hmac html html.parser http http.client http.cookies http.server imaplib
    importlib importlib.metadata importlib.resources inspect io ipaddress itertools json
    json.decoder json.encoder keyword linecache locale logging logging.handlers lzma mailbox
    math mimetypes mmap multiprocessing multiprocessing.pool netrc numbers operator optparse os
    os.path pathlib pickle pickletools pkgutil platform plistlib poplib pprint profile pstats
    queue quopri random re reprlib runpy sched secrets select selectors shelve shlex shutil
    signal site smtplib socket socketserver sqlite3 ssl stat statistics string stringprep
    struct subprocess symtable sys sysconfig tabnanny tarfile tempfile textwrap threading time
    timeit token tokenize trace traceback tracemalloc types typing unicodedata unittest
    unittest.mock urllib urllib.parse urllib.request uuid warnings wave weakref xml.dom
    xml.dom.minidom xml.etree.ElementTree xml.sax zipapp zipfile zipimport zlib zoneinfo
    """.split()
)

HELDOUT_EVERY = 8  # about one module in eight is held out


# 2: signatures without memory addresses (the text must not change between processes)
_CORPUS_FORMAT = "2"


def is_heldout(module_name: str) -> bool:
    digest = hashlib.sha1(module_name.encode()).digest()
    return digest[0] % HELDOUT_EVERY == 0


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def _signature(obj) -> str:
    try:
        signature = str(inspect.signature(obj))
    except (TypeError, ValueError):
        return "(...)"
    # default values such as `<object object at 0x7f4e492c4160>` carry this process's memory addresses: kept,
    # they changed the corpus, its token blocks and every loss measured on it from one process to the next
    return _ADDRESS.sub("", signature)


def _document_module(name: str) -> Optional[str]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            module = importlib.import_module(name)
        except Exception:  # a module missing from a minimal build is skipped, not fatal
            return None
    parts = [f"Module {name}\n\n{inspect.getdoc(module) or ''}".rstrip()]
    public = getattr(module, "__all__", None) or [n for n in dir(module) if not n.startswith("_")]
    for attr in sorted(set(public)):
        obj = getattr(module, attr, None)
        if obj is None or getattr(obj, "__module__", name) not in (name, None):
            continue  # documented where it is defined
        doc = inspect.getdoc(obj) if (inspect.isclass(obj) or callable(obj)) else None
        if not doc:
            continue
        kind = "class" if inspect.isclass(obj) else "def"
        parts.append(f"{kind} {name}.{attr}{_signature(obj)}:\n{doc}")
        if inspect.isclass(obj):
            for meth_name, meth in sorted(vars(obj).items()):
                if meth_name.startswith("_") or not callable(meth):
                    continue
                meth_doc = inspect.getdoc(meth)
                if meth_doc:
                    parts.append(f"def {name}.{attr}.{meth_name}{_signature(meth)}:\n{meth_doc}")
    text = "\n\n".join(parts).strip()
    return text if len(text) > 200 else None


def default_cache_dir() -> Path:
    """Where the corpus is built: ``$SITS_LORA_CACHE`` (default ``~/.cache/sits_lora``)."""
    return cache_root()


def build_stdlib_corpus(cache_dir: Optional[os.PathLike] = None, modules: Iterable[str] = STDLIB_MODULES) -> Path:
    """Write (once) and return a JSONL file: one {"module", "split", "text"} line per module."""
    modules = sorted(modules)
    # the format version is part of the key: a corpus written by an older builder is not reused
    key = hashlib.sha1("\n".join([_CORPUS_FORMAT, *modules]).encode()).hexdigest()[:10]
    version = f"py{sys.version_info.major}{sys.version_info.minor}"
    path = Path(cache_dir or default_cache_dir()) / f"stdlib_docs_{version}_{key}.jsonl"
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w") as f:
        for name in modules:
            text = _document_module(name)
            if text:
                split = "heldout" if is_heldout(name) else "train"
                f.write(json.dumps({"module": name, "split": split, "text": text}) + "\n")
    os.replace(tmp, path)  # never leave a half-written cache behind
    return path


DATASET_SUFFIXES = (".json", ".jsonl", ".txt")


class DatasetTooSmallError(ValueError):
    """The text, once tokenized, does not fill one block: known only after the tokenizer loads."""


def check_dataset_file(path: os.PathLike) -> int:
    """Read a local dataset file the way load_text_splits will, without loading anything heavy; return the
    number of records, or raise (FileNotFoundError / ValueError) with one line naming the file and the fix.

    Run before a model loads, so that an empty file, a record without a "text" string or a malformed
    line stops the recipe in a second instead of after the model and the baseline pass. .json / .jsonl: a
    JSON array of records, or one JSON object per non-blank line; .txt: records are blank-line-separated
    blocks. At least two records (one goes to the held-out split).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"dataset file not found: {path}")
    suffix = path.suffix.lower()
    if suffix not in DATASET_SUFFIXES:
        raise ValueError(f"{path}: unsupported dataset type {suffix!r}; use .json, .jsonl or .txt")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"{path}: not UTF-8 text ({error.reason} at byte {error.start})") from None
    if not text.strip():
        raise ValueError(f"{path}: the file is empty; it needs at least 2 records with text")
    if suffix == ".txt":
        records = _text_blocks(text)
    else:
        records = _json_records(path, text)
        for number, record in records:
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                fields = sorted(record) if isinstance(record, dict) else type(record).__name__
                raise ValueError(f"{path}: record {number} has no 'text' string (found {fields}); every record "
                                 f"needs one, e.g. {{\"text\": \"...\"}}")
    if len(records) < 2:
        raise ValueError(f"{path}: needs at least 2 records to split into train and held-out, found {len(records)}")
    return len(records)


def _text_blocks(text: str) -> list[str]:
    """The records of a .txt dataset: its blank-line-separated blocks, stripped."""
    return [b.strip() for b in text.split("\n\n") if b.strip()]


def _json_records(path: Path, text: str) -> list:
    """(record number, record) pairs of a .json / .jsonl file, as the datasets json loader reads them: a JSON
    array of records, or one record per line."""
    if text.lstrip().startswith("["):
        try:
            return list(enumerate(json.loads(text), 1))
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}: not valid JSON ({error.msg}, line {error.lineno})") from None
    records = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            records.append((number, json.loads(line)))
        except json.JSONDecodeError as error:
            try:
                json.loads(text)
            except json.JSONDecodeError:
                raise ValueError(f"{path}: line {number} is not valid JSON ({error.msg})") from None
            raise ValueError(f"{path}: holds one JSON value over several lines; give a list of records "
                             f"([{{\"text\": ...}}, ...]) or one record per line") from None
    return records


def load_text_splits(path: Optional[os.PathLike] = None, heldout_fraction: float = 0.1, seed: int = 0):
    """(train, heldout) ``datasets.Dataset`` objects with a "text" column.

    ``path`` None: the standard-library corpus with its module-level split. Otherwise a local
    .json / .jsonl (a "text" field per record) or .txt (one record per blank-line-separated
    paragraph block) file, split at random with ``heldout_fraction``.
    """
    import datasets

    if path is None:
        corpus = datasets.load_dataset("json", data_files=str(build_stdlib_corpus()), split="train")
        train = corpus.filter(lambda r: r["split"] == "train")
        heldout = corpus.filter(lambda r: r["split"] == "heldout")
        return train, heldout
    path = Path(path)
    check_dataset_file(path)
    if path.suffix.lower() == ".txt":
        data = datasets.Dataset.from_dict({"text": _text_blocks(path.read_text(encoding="utf-8"))})
    else:
        data = datasets.load_dataset("json", data_files=str(path), split="train")
    parts = data.train_test_split(test_size=heldout_fraction, seed=seed)
    return parts["train"], parts["test"]


def pack_into_blocks(dataset, tokenizer, seq_len: int, max_blocks: Optional[int] = None):
    """Tokenize every text, join them with EOS and cut fixed blocks of ``seq_len`` tokens.

    Returns a ``datasets.Dataset`` with input_ids / attention_mask / labels, ready for causal-LM
    training. Fixed-length blocks make the held-out perplexity a plain mean over tokens.
    """
    import datasets

    eos = tokenizer.eos_token_id
    ids: list[int] = []
    for text in dataset["text"]:
        ids.extend(tokenizer(text, add_special_tokens=False)["input_ids"])
        ids.append(eos)
        if max_blocks is not None and len(ids) >= seq_len * max_blocks:
            break
    n_blocks = len(ids) // seq_len
    if max_blocks is not None:
        n_blocks = min(n_blocks, max_blocks)
    if n_blocks == 0:
        raise DatasetTooSmallError(f"the dataset has {len(ids)} tokens, fewer than one block of seq_len={seq_len}; "
                                   f"lower --seq-len or give more text")
    blocks = [ids[i * seq_len:(i + 1) * seq_len] for i in range(n_blocks)]
    return datasets.Dataset.from_dict(
        {"input_ids": blocks, "attention_mask": [[1] * seq_len] * n_blocks, "labels": blocks}
    )
