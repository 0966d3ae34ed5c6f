"""The data of suite_tiny_mc: the JSON lines beside this file, through the datasets `json` builder."""

from pathlib import Path

import datasets

DATA = Path(__file__).resolve().parent / "suite_tiny_mc.jsonl"


def load(**kwargs):
    """A DatasetDict with one `test` split (lm_eval passes the task's metadata as keywords)."""
    return datasets.load_dataset("json", data_files={"test": str(DATA)})
